"""scripts/bench_scaling.py without launching anything: metrics parsing, efficiency, commands and env.

    .venv/bin/python -m pytest -q tests/test_bench_scaling.py      # < 2 s

The launching itself (a real 1- and 2-process run) is what `scripts/bench_scaling.py --procs 1,2` does;
tests/test_distributed.py already covers the 2-process launch of the loop.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from heads import registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bs():
    spec = importlib.util.spec_from_file_location("bench_scaling", ROOT / "scripts" / "bench_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_scaling"] = mod
    spec.loader.exec_module(mod)
    return mod


def _rows(world: int, windows: list[tuple[int, float]], **start: object) -> list[dict]:
    rows = [{"event": "start", "world_size": world, "grad_accum": 1, "per_process_batch": 4, **start},
            {"event": "eval", "step": 0, "eval/loss": 3.0}]
    rows += [{"event": "train", "step": s, "loss": 1.0, "tokens_per_s": t} for s, t in windows]
    return rows + [{"event": "end", "step": windows[-1][0], "world_size": world}]


def test_first_window_is_dropped_and_the_rest_are_time_weighted(bs) -> None:
    # Window 1 (start-up, 10 tok/s) is ignored. Then 10 steps at 1000 tok/s and 10 steps at 500 tok/s,
    # each window weighted by its time: 20 / (10/1000 + 10/500) = 666.7 tok/s (the plain mean, 750,
    # would over-weight the fast window).
    res = bs.summarize_run(_rows(2, [(10, 10.0), (20, 1000.0), (30, 500.0)]), procs=2, batch_size=4)
    assert res["tokens_per_s"] == pytest.approx(2000 / 3)
    assert (res["steps"], res["timed_steps"], res["windows"], res["world_size"]) == (30, 20, 2, 2)
    assert (res["window_tps_min"], res["window_tps_max"]) == (500.0, 1000.0)
    # A short last window (max_steps not a multiple of log_every) counts for its 2 steps only.
    res = bs.summarize_run(_rows(1, [(5, 1.0), (10, 100.0), (12, 50.0)]), procs=1)
    assert res["tokens_per_s"] == pytest.approx(7 / (5 / 100 + 2 / 50))


def test_world_size_mismatch_fails_loudly(bs) -> None:
    # Two unsynchronised single-process runs (ddp.yaml without ACCELERATE_USE_CPU=1 on CPU) say world 1.
    with pytest.raises(bs.BenchError, match=r"P=2: the run reports world_size=1"):
        bs.summarize_run(_rows(1, [(5, 1.0), (10, 2.0)]), procs=2)
    with pytest.raises(bs.BenchError, match="no start event"):
        bs.summarize_run([{"event": "train", "step": 5, "tokens_per_s": 1.0}], procs=1)
    with pytest.raises(bs.BenchError, match="grad_accum=2"):
        bs.summarize_run(_rows(2, [(5, 1.0), (10, 2.0)], grad_accum=2), procs=2)
    with pytest.raises(bs.BenchError, match="per-process batch 4, asked for 8"):
        bs.summarize_run(_rows(2, [(5, 1.0), (10, 2.0)]), procs=2, batch_size=8)
    with pytest.raises(bs.BenchError, match="1 logged train window"):
        bs.summarize_run(_rows(1, [(5, 1.0)]), procs=1)


def test_efficiency(bs) -> None:
    assert bs.efficiency(1800.0, 2, 1000.0) == pytest.approx(0.9)  # 1800 / (2 x 1000)
    assert bs.efficiency(3000.0, 4, 1000.0) == pytest.approx(0.75)
    assert bs.efficiency(3000.0, 8, 1000.0, base_procs=2) == pytest.approx(0.75)  # ideal 4 x 1000
    rows = [{"procs": 2, "tokens_per_s": 1500.0}, {"procs": 1, "tokens_per_s": 1000.0},
            {"procs": 4, "tokens_per_s": 3200.0}]
    bs.add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == pytest.approx([0.75, 1.0, 0.8])
    assert [r["tokens_per_s_per_proc"] for r in rows] == pytest.approx([750.0, 1000.0, 800.0])


def test_arguments(bs) -> None:
    assert bs.parse_procs("4,1, 2,2") == [1, 2, 4]
    for bad in ("", "0,1", "a,2"):
        with pytest.raises(ValueError):
            bs.parse_procs(bad)
    bs.check_overrides(["--head.ttt_length=2", "--data.max_length=128"])
    with pytest.raises(ValueError, match="use --batch-size"):
        bs.check_overrides(["--train.batch_size=8"])
    with pytest.raises(ValueError, match="the benchmark sets it"):
        bs.check_overrides(["--train.global_batch_size=16"])
    with pytest.raises(ValueError, match="look like --key.sub=value"):
        bs.check_overrides(["--head.ttt_length", "2"])
    for family in registry.names():  # its own entry script, else the generic one; each exists
        script = registry.get(family).script
        assert bs.entry_for(family) == (f"train/{script}.py" if script else "train/__main__.py")
        assert (ROOT / bs.entry_for(family)).is_file()
    assert bs.entry_for("eagle3") == "train/eagle.py" and bs.entry_for("mtp") == "train/mtp.py"
    with pytest.raises(ValueError, match="no training entry"):
        bs.entry_for("hydra")


def test_commands_and_environment(bs, tmp_path: Path) -> None:
    args = bs.run_args("c.yaml", 50, 4, 5, ["--head.ttt_length=2"], tmp_path / "p2")
    assert args[:3] == ["--config", "c.yaml", "--head.ttt_length=2"]
    # The benchmark's settings come after the user's overrides, so they win.
    for flag in ("--train.batch_size=4", "--train.global_batch_size=null", "--optim.grad_accum=1",
                 "--train.max_steps=50", "--train.log_every=5"):
        assert flag in args[3:]
    assert args[-2:] == ["--out", str(tmp_path / "p2")]

    assert bs.build_command("train/eagle.py", 1, "ddp.yaml", ["--x=1"], python="py") == ["py", "train/eagle.py", "--x=1"]
    assert bs.build_command("train/mtp.py", 4, "ddp.yaml", ["--x=1"], python="py") == [
        "py", "-m", "accelerate.commands.launch", "--config_file", "ddp.yaml", "--num_processes", "4",
        "--main_process_port", "0", "train/mtp.py", "--x=1"]

    base = {"ACCELERATE_USE_CPU": "1", "PATH": "/bin"}
    cpu_ddp = bs.child_env(2, "MULTI_GPU", cuda=False, cpu_count=8, base=base)
    assert (cpu_ddp["ACCELERATE_USE_CPU"], cpu_ddp["OMP_NUM_THREADS"], cpu_ddp["WANDB_MODE"]) == ("1", "4", "disabled")
    # DeepSpeed on CPU: ACCELERATE_USE_CPU would silently turn it into plain DDP (even if inherited).
    assert "ACCELERATE_USE_CPU" not in bs.child_env(2, "DEEPSPEED", cuda=False, cpu_count=2, base=base)
    single = bs.child_env(1, "MULTI_GPU", cuda=False, cpu_count=2, base=base)
    assert "ACCELERATE_USE_CPU" not in single and single["OMP_NUM_THREADS"] == "2"
    assert bs.child_env(3, "MULTI_GPU", cuda=False, cpu_count=2, base={})["OMP_NUM_THREADS"] == "1"
    gpu = bs.child_env(8, "MULTI_GPU", cuda=True, cpu_count=64, base={})
    assert "ACCELERATE_USE_CPU" not in gpu and "OMP_NUM_THREADS" not in gpu

    assert bs.distributed_type(ROOT / "configs" / "accelerate" / "ddp.yaml") == "MULTI_GPU"
    assert bs.distributed_type(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml") == "DEEPSPEED"
