"""The vLLM feature path past the engine, without vLLM (default suite, tiny random Llama, a few seconds):

    .venv/bin/python -m pytest -q tests/test_vllm_capture.py

A stand-in for data.vllm_capture.VllmCapture hands over what vLLM's `extract_hidden_states` hands over
(transformers' hidden_states[i] for the asked indices, index L as the last layer's output BEFORE the final
norm), computed with transformers. Checked: data.vllm_capture.vllm_features packs rows, `last` and the argmax
exactly like data.extract's transformers source; check_numerics passes the right capture and refuses a wrong
layer index and an engine that hands the last layer already normed (our norm would apply twice); the online
stream through vLLM gives the transformers stream's batches; scripts/slurm/extract.sbatch's vLLM form (run with a stand-in for python
that prints the commands) starts G / TP processes, each on its own TP GPUs and its own rank slice of the array.
The real engine is in tests/test_vllm.py (`-m vllm`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.config import load_config
from data.extract import transformers_source
from data.featureset import open_featureset
from data.target import final_norm
from data.tokenize import tokenize_records
from data.vllm_capture import NumericsError, check_numerics, numerics_markdown, vllm_features

LAYERS = [1, 3]


class FakeCapture:
    """VllmCapture's interface (layer_ids, capture_ids, hidden_states) over transformers; post_norm plants
    the bug of an engine that applies the final norm before handing the last layer over."""

    def __init__(self, model, layer_ids, capture_ids=None, post_norm=False):
        self.model, self.layer_ids, self.post_norm = model, list(layer_ids), post_norm
        n = model.config.num_hidden_layers
        self.capture_ids = list(capture_ids) if capture_ids is not None else [*layer_ids, n]

    def hidden_states(self, rows):
        out, seen = [], {}
        for row in rows:
            seen.clear()
            hook = final_norm(self.model).register_forward_pre_hook(lambda m, a: seen.setdefault("pre", a[0]))
            with torch.no_grad():
                hs = self.model(input_ids=torch.tensor([list(row)]), output_hidden_states=True).hidden_states
            hook.remove()
            last = len(hs) - 1  # transformers' hidden_states[L] is post-norm; vLLM's index L is not
            out.append(torch.stack([seen["pre"][0] if i == last and not self.post_norm else hs[i][0]
                                    for i in self.capture_ids], dim=1))
        return out


@pytest.fixture(scope="module")
def rows(tiny_target):
    _, tok, _ = tiny_target
    ds = tokenize_records([{"id": f"c{i}", "messages": [{"role": "user", "content": "question " * (2 + 3 * i)},
                                                        {"role": "assistant", "content": "answer " * (1 + i)}]}
                           for i in range(3)], tok, 256)
    return ds[[0, 1, 2]]


def test_vllm_features_pack_like_the_transformers_source(tiny_target, rows):
    model, tok, _ = tiny_target
    want_x, want_top = transformers_source(model, LAYERS, tok.pad_token_id)(rows)  # padded batch, unpadded rows
    got_x, got_top = vllm_features(model, FakeCapture(model, LAYERS), rows["input_ids"])
    assert got_x.shape == want_x.shape == (sum(len(r) for r in rows["input_ids"]), 64 * 3)
    torch.testing.assert_close(got_x, want_x, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_top, want_top)


def test_check_numerics_passes_the_right_capture_and_refuses_a_wrong_index_or_a_second_norm(tiny_target, rows):
    model, _, _ = tiny_target
    samples = rows["input_ids"]
    report = check_numerics(model, FakeCapture(model, LAYERS), samples, 0.02)
    assert [r["layer"] for r in report["layers"]] == ["last", "1", "3"]
    assert all(r["rel"] < 1e-5 for r in report["layers"]) and report["argmax_agreement"] == 1.0
    assert "| 3 |" in numerics_markdown(report)
    with pytest.raises(NumericsError, match=r"features.vllm_check_tolerance: vLLM's capture of layer [13] "):
        check_numerics(model, FakeCapture(model, LAYERS, capture_ids=[2, 4, 4]), samples, 0.02)  # one too deep
    norm = final_norm(model).weight
    saved = norm.detach().clone()
    try:
        # The tiny target's norm weight is all ones, and an RMSNorm with uniform weights is idempotent (a
        # second norm would change nothing); real targets' weights vary per channel, as here.
        with torch.no_grad():
            norm.copy_(torch.linspace(0.5, 2.0, norm.numel()))
        assert check_numerics(model, FakeCapture(model, LAYERS), samples, 0.02)["layers"][0]["rel"] < 1e-5
        with pytest.raises(NumericsError, match="capture of layer last ") as e:
            check_numerics(model, FakeCapture(model, LAYERS, post_norm=True), samples, 0.02)
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    assert e.value.report["layers"][1]["rel"] < 1e-5  # the other layers were right: only `last` is named


def test_the_online_stream_through_vllm_gives_the_transformers_streams_batches(tiny_target):
    """features.mode online with engine vllm: FeatureSet batches from the capture (right padded, zero there, the
    argmax from our lm_head) equal the transformers stream's; the engine's capture is required."""
    model, tok, _ = tiny_target
    ds = tokenize_records([{"id": f"c{i}", "messages": [{"role": "user", "content": "question " * (2 + 3 * i)},
                                                        {"role": "assistant", "content": "answer " * (1 + i)}]}
                           for i in range(3)], tok, 256)
    cfg = load_config(None, ["--features.mode=online", "--features.engine=vllm"])
    with pytest.raises(ValueError, match="online needs the run's capture"):
        open_featureset(cfg, ds, model, LAYERS, "train")
    engine = open_featureset(cfg, ds, model, LAYERS, "train", tok.pad_token_id, capture=FakeCapture(model, LAYERS))
    plain = open_featureset(load_config(None, ["--features.mode=online"]), ds, model, LAYERS, "train",
                            tok.pad_token_id)
    got, want = engine.batch([2, 0, 1]), plain.batch([2, 0, 1])  # ragged lengths, longest first
    assert got.keys() == want.keys() >= {"last", "aux", "target_argmax", "attention_mask"}
    for key in ("last", "aux"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)
    assert torch.equal(got["target_argmax"], want["target_argmax"])
    assert (got["last"][1, int(got["attention_mask"][1].sum()):] == 0).all()  # padding zero, as the store's


def test_extract_sbatch_runs_one_vllm_process_per_tp_group_of_the_node(tmp_path):
    stub = tmp_path / "python"
    # -c (the sbatch reading features.engine from the config) runs the real interpreter; a run is printed
    stub.write_text(f'#!/bin/bash\nif [[ $1 == -c ]]; then exec {sys.executable} "$@"; fi\n'
                    'echo "GPUS=${CUDA_VISIBLE_DEVICES:-none} $*"\n')
    stub.chmod(0o755)
    root = Path(__file__).resolve().parents[1]

    def task(index: int, count: int, gpus: int, *overrides: str) -> list[str]:
        env = dict(os.environ, PYTHON=str(stub), ACCELERATE=str(stub), SLURM_ARRAY_TASK_ID=str(index), SLURM_ARRAY_TASK_COUNT=str(count),
                   SLURM_GPUS_ON_NODE=str(gpus), SLURM_SUBMIT_DIR=str(root))
        env.pop("CUDA_VISIBLE_DEVICES", None)
        r = subprocess.run(["bash", "scripts/slurm/extract.sbatch", "configs/llama8b.yaml", str(tmp_path / "run"),
                            *overrides], cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if line.startswith("GPUS=")]

    # task 1 of 2, 4 GPUs, TP 2: 2 processes, started in the background, so their lines arrive in either order;
    # sorted by GPU group, each group must still carry its own shard
    runs = sorted(task(1, 2, 4, "--features.vllm_tensor_parallel_size=2"))
    assert [line.split(" -m ")[0] for line in runs] == ["GPUS=0,1", "GPUS=2,3"]
    assert ["--shard-index 2 --num-shards 4" in runs[0], "--shard-index 3 --num-shards 4" in runs[1]] == [True, True]
    assert all("data.extract" in line and "accelerate" not in line for line in runs)
    assert [line.split(" -m ")[0] for line in task(0, 1, 0)] == ["GPUS=none"]  # CPU: one process
    plain = task(0, 1, 0, "--features.engine=transformers")  # accelerate launch as before
    assert len(plain) == 1 and plain[0].startswith("GPUS=none launch ")
