"""oneDNN-prepacked linear layers (data.packed): same outputs as the dense target, dense under autograd.

    .venv/bin/python -m pytest -q tests/test_packed.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from data.config import TargetConfig
from data.packed import MIN_PACKED_NUMEL, PackedLinear, pack_linears
from data.target import load_model, load_target

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-qwen2"])  # qwen2: q/k/v carry a bias
def test_packed_target_matches_dense(name: str) -> None:
    dense = load_model(TargetConfig(name_or_path=name, device="cpu"))
    with torch.no_grad():  # transformers initialises biases to zero, which would hide a dropped bias
        for m in dense.modules():
            if type(m) is nn.Linear and m.bias is not None:
                m.bias.normal_()
    packed = load_model(TargetConfig(name_or_path=name, device="cpu"))
    packed.load_state_dict(dense.state_dict())
    # the tiny targets' matrices are all below MIN_PACKED_NUMEL: pack every one to test the kernel
    assert pack_linears(packed, min_numel=0) == sum(type(m) is nn.Linear for m in dense.modules()) > 0
    assert packed.state_dict().keys() == dense.state_dict().keys()  # saving and fingerprints see the same
    ids = torch.randint(0, 200, (2, 9))
    with torch.inference_mode():
        for rows in (1, 2, 3, 9):  # 1-3 rows are the shapes where dense kernels misbehave on CPUs
            want = dense(ids[:, :rows]).logits
            got = packed(ids[:, :rows]).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_packed_linear_is_dense_under_autograd() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 5)
    ref = nn.Linear(8, 5)
    ref.load_state_dict(lin.state_dict())
    wrapped = nn.Sequential(lin)
    assert pack_linears(wrapped, min_numel=0) == 1 and isinstance(wrapped[0], PackedLinear)
    assert wrapped[0].weight is lin.weight  # shared, not copied: tying and optimizers still see one tensor
    x = torch.randn(3, 8, requires_grad=True)
    y = wrapped(x)
    assert torch.equal(y, ref(x))  # the dense kernel, bit for bit, so training never goes through oneDNN
    y.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None


def test_only_large_float32_matrices_are_packed() -> None:
    big = nn.Linear(2048, MIN_PACKED_NUMEL // 2048)
    model = nn.Sequential(nn.Linear(64, 64), big, nn.Linear(2048, 8).to(torch.bfloat16))
    assert pack_linears(model) == 1 and isinstance(model[1], PackedLinear) and model[1].weight is big.weight


def test_load_model_packs_for_decoding_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("data.packed.MIN_PACKED_NUMEL", 0)  # pack the tiny target's matrices too
    cfg = TargetConfig(name_or_path="tiny-random-llama", device="cpu")
    for packed in (load_model(cfg, decode=True), load_target(cfg, decode=True)[0]):
        assert any(isinstance(m, PackedLinear) for m in packed.modules())
    dense_cfg = TargetConfig(**{**vars(cfg), "cpu_kernels": "dense"})
    for model in (load_model(cfg), load_target(cfg)[0], load_model(dense_cfg, decode=True)):
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
