"""scripts/gpu_check.py --tiny: the GPU check's code runs on CPU, without the packages the GPU image lacks, and
writes every key the full run writes.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import run

ROOT = Path(__file__).resolve().parents[1]
MISSING_ON_GPU_IMAGE = ("datasets", "wandb", "gguf", "deepspeed")

# Runs the script with those packages invisible (found by no finder, as on the GPU image).
BOOTSTRAP = f"""
import importlib.machinery, runpy, sys
find = importlib.machinery.PathFinder.find_spec
def hidden(cls, name, path=None, target=None):
    return None if name.split(".")[0] in {MISSING_ON_GPU_IMAGE!r} else find(name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(hidden)
sys.argv = ["gpu_check.py"] + sys.argv[1:]
runpy.run_path({str(ROOT / "scripts" / "gpu_check.py")!r}, run_name="__main__")
"""

NS = [str(n) for n in range(1, 65)]
KS = [str(k) for k in range(1, 9)]
ORACLE_ROW = {"tau", "tau_exact", "pass_ms", "verify_ms", "overhead_ms", "overhead_frac", "tokens_per_s"}
SECTIONS = {
    "verify_cost": {"context_len", "ns", "dynamic_ms", "static_ms"},
    "oracle": {"passes", "prompt_len", "dynamic", "static", "dynamic_syncs_per_pass", "static_syncs_per_pass"},
    "plain": {"new_tokens", "dynamic_tokens_per_s", "static_tokens_per_s", "graphs_speedup", "static_graphs",
              "graph_error"},
    "head_train": {"batch", "seq_len", "ttt_length", "draft_vocab", "layer_ids", "step_s", "tokens_per_s",
                   "tflops_per_s", "mfu", "head_mfu", "peak_tflops"},
    "extract": {"rows", "seq_len", "layer_ids", "extract_tokens_per_s", "plain_tokens_per_s", "ratio"},
    "batch_heads": {"k", "new_tokens", "prompt_len", "1", "2"},
}
BATCH_ROW = {"plain_pass_ms", "together_pass_ms", "alone_pass_ms", "tau", "identical"}


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", BOOTSTRAP, *args], timeout=timeout, cwd=ROOT,
               env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_tiny_check_writes_every_key_without_the_missing_packages(tmp_path):
    out = tmp_path / "out.json"
    res = _run(["--tiny", "--json", str(out)], timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (tmp_path / "out.md").read_text().startswith("| measure | value |")
    assert set(r) == {"tiny", "env", "shapes", "sections", "build", "total_s", *SECTIONS}
    assert set(r["sections"]) == {"build", *SECTIONS}
    assert all(sec["error"] is None for sec in r["sections"].values())
    for name, keys in SECTIONS.items():
        assert set(r[name]) == keys, name
    for kind in ("dynamic", "static"):
        curve = r["verify_cost"][f"{kind}_ms"]
        assert list(curve) == NS and all(v > 0 for v in curve.values())
        rows = r["oracle"][kind]
        assert list(rows) == KS and all(set(row) == ORACLE_ROW for row in rows.values())
        # fp32 on CPU: the oracle's drafts are all accepted, tau = k + 1 exactly
        assert all(row["tau_exact"] and row["tau"] == int(k) + 1 for k, row in rows.items())
    assert r["head_train"]["tokens_per_s"] > 0 and r["extract"]["ratio"] > 0
    for b in ("1", "2"):  # batched decoding with the head's rows together and alone: plain's tokens
        row = r["batch_heads"][b]
        assert set(row) == BATCH_ROW and row["identical"] and row["alone_pass_ms"] > 0


def test_full_check_refuses_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU would run the real check")
    main = runpy.run_path(str(ROOT / "scripts" / "gpu_check.py"))["main"]
    assert main(["--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--tiny" in err
    assert main(["--tiny", "--only", "bogus"]) == 2 and "unknown section 'bogus'" in capsys.readouterr().err


def test_sections_past_the_deadline_are_skipped_and_saved(tmp_path):
    main = runpy.run_path(str(ROOT / "scripts" / "gpu_check.py"))["main"]
    out = tmp_path / "late.json"
    assert main(["--tiny", "--deadline-s", "0", "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["sections"]["build"]["error"].startswith("skipped") and r["build"] is None and r["oracle"] is None
    assert "skipped" in (tmp_path / "late.md").read_text()
