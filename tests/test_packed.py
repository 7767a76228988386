"""CPU kernels for the verify pass (data.packed): oneDNN-prepacked and per-row-count ("skinny") linear layers give
the dense target's outputs, are dense under autograd, and `auto` keeps the one timed fastest.

    .venv/bin/python -m pytest -q tests/test_packed.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from data.config import TargetConfig
from data.packed import (
    MIN_PACKED_NUMEL,
    MIN_SMALL_NUMEL,
    SKINNY_KERNELS,
    PackedLinear,
    SkinnyLinear,
    choose_kernels,
    pack_linears,
    plan_rows,
    skinny_linears,
)
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


def test_a_deep_copy_of_a_packed_layer_is_a_dense_linear_of_copied_weights() -> None:
    """An MTP head starts from a copy of the target's last layer; on a packed target (eval on a CPU where packing
    wins) the copy failed on oneDNN's storage-less tensor. The copy: nn.Linear, same outputs, its own weights."""
    import copy
    import dataclasses

    from heads import mtp

    _, _, io = load_target(TargetConfig(name_or_path="tiny-random-llama", device="cpu"))
    layer = copy.deepcopy(io.last_layer)
    dense = copy.deepcopy(layer)
    assert pack_linears(layer, min_numel=0) > 0 and isinstance(layer.self_attn.q_proj, PackedLinear)
    twin = copy.deepcopy(layer)
    assert type(twin.self_attn.q_proj) is nn.Linear and twin.self_attn.q_proj.weight is not layer.self_attn.q_proj.weight
    x = torch.randn(1, 5, io.hidden_size)
    pe = io.rotary(x, torch.arange(5)[None])
    with torch.inference_mode():
        want = dense(x, position_embeddings=pe)
        want = want[0] if isinstance(want, tuple) else want
        got = twin(x, position_embeddings=pe)
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, want)
    with torch.no_grad():
        twin.self_attn.q_proj.weight.add_(1.0)
    assert not torch.equal(twin.self_attn.q_proj.weight, layer.self_attn.q_proj.weight)
    head = mtp.build(mtp.MTPConfig(num_modules=1), dataclasses.replace(io, last_layer=layer))  # copies it
    assert not any(isinstance(m, PackedLinear) for m in head.modules())


def test_float32_matrices_above_the_small_floor_are_packed() -> None:
    big = nn.Linear(2048, MIN_PACKED_NUMEL // 2048)
    mid = nn.Linear(256, MIN_SMALL_NUMEL // 256)
    model = nn.Sequential(nn.Linear(64, 64), mid, big, nn.Linear(2048, 8).to(torch.bfloat16))
    assert pack_linears(model) == 2 and isinstance(model[1], PackedLinear) and isinstance(model[2], PackedLinear)
    assert model[2].weight is big.weight and type(model[0]) is nn.Linear and type(model[3]) is nn.Linear
    # a decode step's single row takes the dense kernel through the smaller matrices only
    assert model[1].dense_single_row and not model[2].dense_single_row


def test_single_row_takes_the_dense_kernel_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    calls = []
    real = torch._C._nn.mkldnn_linear
    monkeypatch.setattr(torch._C._nn, "mkldnn_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for dense_single_row, want in ((True, [3]), (False, [1, 3])):
            calls.clear()
            packed = PackedLinear(lin, dense_single_row=dense_single_row)
            one, three = torch.randn(1, 1, 32), torch.randn(1, 3, 32)
            if dense_single_row:
                assert torch.equal(packed(one), lin(one))  # bit for bit: the dense kernel
            else:
                torch.testing.assert_close(packed(one), lin(one), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(packed(three), lin(three), rtol=1e-5, atol=1e-5)
            assert calls == want


def test_load_model_packs_for_decoding_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("data.packed.MIN_SMALL_NUMEL", 0)  # pack the tiny target's matrices too
    cfg = TargetConfig(name_or_path="tiny-random-llama", device="cpu", cpu_kernels="packed")
    for packed in (load_model(cfg, decode=True), load_target(cfg, decode=True)[0]):
        assert any(isinstance(m, PackedLinear) for m in packed.modules())
    auto = TargetConfig(name_or_path="tiny-random-llama", device="cpu")  # batched generation runs dense under auto
    dense_cfg = TargetConfig(**{**vars(cfg), "cpu_kernels": "dense"})
    for model in (load_model(cfg), load_target(cfg)[0], load_model(dense_cfg, decode=True),
                  load_model(auto, decode=True)):
        assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("faster, margin_ok", [("packed", True), ("packed", False), ("skinny", True),
                                               ("skinny", False), ("dense", True)])
def test_auto_keeps_a_kernel_only_where_it_times_clearly_faster(monkeypatch: pytest.MonkeyPatch, faster: str,
                                                                margin_ok: bool) -> None:
    monkeypatch.setattr("data.packed.MIN_SMALL_NUMEL", 0)
    plain = [0.050, 0.050, 0.055, 0.075]
    other = [t * (0.8 if margin_ok else 0.95) for t in plain]  # 20% cheaper, or within the 10% margin
    slower = [t * 1.5 for t in plain]
    timed = {"dense": plain, "packed": slower, "skinny": slower}
    if faster == "dense":
        timed["packed"] = timed["skinny"] = [t / 0.8 for t in plain]
    else:
        timed[faster] = other
    monkeypatch.setattr("data.packed._time_passes", lambda *a: timed)
    cfg = TargetConfig(name_or_path="tiny-random-llama", device="cpu")  # cpu_kernels auto is the default
    dense = load_model(cfg)
    model = load_model(cfg, decode=True, verify=True)
    kept = faster if margin_ok else "dense"
    kinds = {"packed": PackedLinear, "skinny": SkinnyLinear}
    for kind, cls in kinds.items():
        assert any(isinstance(m, cls) for m in model.modules()) == (kind == kept)
    assert model.state_dict().keys() == dense.state_dict().keys()
    ids = torch.randint(0, 200, (1, 5))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)
    if kept == "dense":  # back to the very same Parameters, with the dense kernel bit for bit
        assert all(type(m) not in kinds.values() for m in model.modules())
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, dense(ids).logits)


def test_auto_times_real_passes_and_installs_its_choice(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("data.packed.MIN_SMALL_NUMEL", 0)
    model = load_model(TargetConfig(name_or_path="tiny-random-llama", device="cpu"))
    kind = choose_kernels(model, rows=(1, 2), context=8, repeats=1)
    assert kind in ("packed", "skinny", "dense")
    assert any(isinstance(m, PackedLinear) for m in model.modules()) == (kind == "packed")
    assert any(isinstance(m, SkinnyLinear) for m in model.modules()) == (kind == "skinny")
    assert f"target.cpu_kernels auto: {kind} (T(1..2) dense " in capsys.readouterr().err
    assert choose_kernels(nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16))) == "dense"  # nothing to pack: untimed


@pytest.mark.parametrize("kernel", SKINNY_KERNELS)
def test_every_skinny_kernel_gives_the_dense_rows(kernel: str) -> None:
    """Each kernel, with and without zero rows padding the product, against F.linear with the bias."""
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)
    with torch.no_grad():
        lin.bias.normal_()
    plan = {1: (kernel, 1), 2: (kernel, 4), 3: (kernel, 3), 4: (kernel, 4)}  # 2 rows computed as 4
    layer = SkinnyLinear(lin, plan)
    assert layer.weight is lin.weight and layer.bias is lin.bias  # shared: tying and fingerprints see one tensor
    assert (layer._wt is not None) == (kernel == "xw")  # the W^T copy only where a row count uses it
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 9):  # 9: no plan, F.linear
            x = torch.randn(1, rows, 24)
            got = layer(x)
            assert got.shape == (1, rows, 40)
            assert got.is_contiguous()  # "wx" rows left transposed slowed the next layer's kernel threefold
            torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 24, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, lin(x))  # autograd takes the dense kernel, bit for bit: training never goes through it
    y.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    import copy

    twin = copy.deepcopy(layer)
    assert type(twin) is nn.Linear and twin.weight is not lin.weight and torch.equal(twin.weight, lin.weight)


def test_plan_rows_takes_the_fastest_kernel_and_pads_where_more_rows_are_cheaper(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake clock prices each (kernel, rows) cell; the plan must pick the cheapest cell at or above each row count:
    three rows through "wx" cost twice four (as measured on an AMD EPYC), so three are computed as four."""
    cost = {("dense", m): 10.0 * m for m in range(1, 5)}
    cost.update({("wx", 1): 12.0, ("wx", 2): 6.0, ("wx", 3): 14.0, ("wx", 4): 7.0})
    cost.update({("xw", m): 5.0 if m == 1 else 50.0 for m in range(1, 5)})
    clock = [0.0]
    monkeypatch.setattr("data.packed.time.perf_counter", lambda: clock[0])

    def fake(kernel: str, x: torch.Tensor, weight: torch.Tensor, wt: torch.Tensor | None) -> None:
        clock[0] += cost[kernel, x.shape[0]]

    monkeypatch.setattr("data.packed._kernel", fake)
    plan = plan_rows([nn.Linear(8, 8), nn.Linear(8, 8)], rows=4, repeats=2)
    assert plan == {1: ("xw", 1), 2: ("wx", 2), 3: ("wx", 4), 4: ("wx", 4)}


def test_skinny_target_matches_dense_and_loads_for_decoding_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("data.packed.MIN_SMALL_NUMEL", 0)  # the tiny target's matrices are all small
    cfg = TargetConfig(name_or_path="tiny-random-qwen2", device="cpu", cpu_kernels="skinny")  # q/k/v carry a bias
    dense = load_model(cfg)
    assert not any(isinstance(m, SkinnyLinear) for m in dense.modules())
    with torch.no_grad():
        for m in dense.modules():
            if type(m) is nn.Linear and m.bias is not None:
                m.bias.normal_()
    skinny = load_model(cfg, decode=True)
    skinny.load_state_dict(dense.state_dict())
    layers = [m for m in skinny.modules() if isinstance(m, SkinnyLinear)]
    assert len(layers) == sum(type(m) is nn.Linear for m in dense.modules()) > 0
    assert skinny.state_dict().keys() == dense.state_dict().keys()
    ids = torch.randint(0, 200, (2, 9))
    with torch.inference_mode():
        for rows in (1, 2, 3, 9):
            torch.testing.assert_close(skinny(ids[:, :rows]).logits, dense(ids[:, :rows]).logits, rtol=1e-4, atol=1e-4)
    assert skinny_linears(nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16))) == 0  # not float32: left dense
