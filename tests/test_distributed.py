"""Data-parallel equivalence and the accelerate launcher configs (configs/accelerate/).

    .venv/bin/python -m pytest -q tests/test_distributed.py            # ~40 s on 2 idle cores
    .venv/bin/python -m pytest -q -m slow tests/test_distributed.py    # + DeepSpeed ZeRO-2/3 on CPU

The equivalence test trains the tiny EAGLE-3 config for a few steps twice, in parallel: one process with
global batch B (micro-batches of B/2, two accumulation rounds) and two processes (gloo DDP through
`accelerate launch --config_file configs/accelerate/ddp.yaml` with ACCELERATE_USE_CPU=1) with B/2 each.
It relies on the loop's contract (train/loop.py): an optimizer step consumes the same global micro-batches
whatever the process count, metrics.jsonl has a `start` event with world_size and `train` rows with the
loss averaged over ranks, every rank writes final_params_digest.rank{R}.txt, and OUT/head holds the head.
Every `accelerate launch` here goes through tests/exit_probe.py (it runs the train/ entry script), which reports
whether the run's process groups ended in its teardown; DDP and ZeRO-2 runs must leave none behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from procs import finish, free_port, start
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
ACCEL = REPO / "configs" / "accelerate"
EXIT_PROBE = REPO / "tests" / "exit_probe.py"
STEPS = 3
# Global batch 4 = 2 sequences per micro-batch x (1 process x 2 rounds | 2 processes x 1 round).
RUN_ARGS = [
    "--config", str(REPO / "configs" / "tiny-eagle.yaml"),
    f"--train.max_steps={STEPS}", "--train.batch_size=2", "--train.global_batch_size=4",
    "--data.max_samples=24", "--head.draft_vocab_size=32",
    "--train.log_every=1", "--train.eval_every=1000", "--train.checkpoint_every=1000",
]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("ACCELERATE_USE_CPU", None)
    env.update(extra)
    return env


def _launch(accel_config: str, out: Path, env: dict[str, str], args: list[str] = RUN_ARGS,
            entry: str = "eagle.py") -> subprocess.Popen:
    """2 processes of train/<entry> under `accelerate launch` with one of our launcher configs, through
    tests/exit_probe.py (which reports whether the run's process groups ended)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCEL / accel_config),
           "--num_processes", "2", "--main_process_port", "0",  # 0: torch binds a free port itself
           str(EXIT_PROBE), entry, *args, "--out", str(out)]
    return start(cmd, cwd=REPO, env=env)


def _single(out: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "train" / "eagle.py"), *RUN_ARGS, "--out", str(out)]
    return start(cmd, cwd=REPO, env=_env())


def _finish(proc: subprocess.Popen, what: str, timeout: float = 600) -> str:
    """Wait for proc (its output); on timeout its whole process group is killed (tests/procs.py) and the
    test fails."""
    try:
        rc, text = finish(proc, timeout)
    except TimeoutError as e:
        pytest.fail(f"{what}: {e}")
    assert rc == 0, f"{what} exited with {rc}; output tail:\n{text[-3000:]}"
    return text


def _assert_groups_ended(text: str, what: str) -> None:
    """Both ranks' tests/exit_probe.py lines: gloo threads ran before teardown and none outlived the run.
    A surviving group's threads are still running at interpreter shutdown, which now and then aborts a
    finished run (SIGABRT, "terminate called without an active exception")."""
    found = re.findall(r"exit probe: rank (\d+), gloo threads before teardown (\d+), after the run \[([^\]]*)\]", text)
    assert sorted(r for r, _, _ in found) == ["0", "1"], f"{what}: no exit probe line per rank:\n{text[-3000:]}"
    for rank, before, after in found:
        assert int(before) > 0, f"{what}, rank {rank}: no gloo threads recognised before teardown"
        assert after == "", f"{what}, rank {rank}: process-group threads outlived the run: {after}"


def _metrics(out: Path) -> tuple[int, list[float]]:
    """(world size from the start event, per-step training loss)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    world = next(r["world_size"] for r in rows if r["event"] == "start")
    train = [r for r in rows if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)), f"{out}: train rows {train}"
    return world, [r["loss"] for r in train]


def _placement(out: Path) -> dict[str, object]:
    """The frozen target's placement recorded in the start event (rank 0's numbers)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in rows if r["event"] == "start")
    return {k: start[k] for k in ("distributed_type", "target_placement", "target_layer_params",
                                  "target_layer_params_local")}


def _digests(out: Path) -> list[str]:
    return [p.read_text().strip() for p in sorted(out.glob("final_params_digest.rank*.txt"))]


def _assert_heads_close(a: Path, b: Path, atol: float) -> None:
    ta, tb = load_file(a / "head" / "model.safetensors"), load_file(b / "head" / "model.safetensors")
    assert ta.keys() == tb.keys()
    for k in ta:
        torch.testing.assert_close(ta[k].float(), tb[k].float(), atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.distributed
def test_two_processes_with_half_batch_match_one_process(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    procs = [(_single(one), "1-process run"),
             (_launch("ddp.yaml", two, _env(ACCELERATE_USE_CPU="1")), "2-process DDP run")]
    texts = {what: _finish(proc, what) for proc, what in procs}
    _assert_groups_ended(texts["2-process DDP run"], "2-process DDP run")

    world1, loss1 = _metrics(one)
    world2, loss2 = _metrics(two)
    assert (world1, world2) == (1, 2)
    # Same micro-batches, same normalisation: only the float summation order differs.
    assert loss2 == pytest.approx(loss1, rel=1e-5, abs=1e-6)
    # The loss moved: a run that silently trained nothing (e.g. two unsynchronised ranks) would not
    # keep matching step after step.
    assert len(set(loss1)) == STEPS
    d1, d2 = _digests(one), _digests(two)
    assert len(d1) == 1 and len(d2) == 2
    assert d2[0] == d2[1], "the two DDP ranks ended with different head parameters"
    _assert_heads_close(one, two, atol=1e-6)


@pytest.mark.distributed
def test_two_machines_match_one_process(tmp_path: Path) -> None:
    """The multi-node launch scripts/slurm/train.sbatch makes (one `accelerate launch` per node with
    --num_machines/--machine_rank/--main_process_ip/--main_process_port), played by two launchers on this
    host with one process each: they rendezvous into one world of 2 and train what 1 process trains."""
    one, two = tmp_path / "one", tmp_path / "two"
    port = str(free_port())
    procs = [(_single(one), "1-process run")]
    for machine in ("0", "1"):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCEL / "ddp.yaml"),
               "--num_machines", "2", "--machine_rank", machine, "--main_process_ip", "127.0.0.1",
               "--main_process_port", port, "--num_processes", "2",
               str(EXIT_PROBE), "eagle.py", *RUN_ARGS, "--out", str(two)]
        procs.append((start(cmd, cwd=REPO, env=_env(ACCELERATE_USE_CPU="1")), f"machine {machine}"))
    texts = {what: _finish(proc, what) for proc, what in procs}
    _assert_groups_ended(texts["machine 0"] + texts["machine 1"], "2-machine DDP run")
    (world1, loss1), (world2, loss2) = _metrics(one), _metrics(two)
    assert (world1, world2) == (1, 2)
    assert loss2 == pytest.approx(loss1, rel=1e-5, abs=1e-6)
    d2 = _digests(two)
    assert len(d2) == 2 and d2[0] == d2[1]
    _assert_heads_close(one, two, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize(("accel_config", "message"), [
    ("ddp.yaml", "accelerate runs them unsynchronised"),
    ("fsdp.yaml", "asks for FSDP, but accelerate runs NO"),
])
def test_unsynchronised_launch_is_refused(tmp_path: Path, accel_config: str, message: str) -> None:
    """Without GPUs accelerate runs ddp.yaml (without ACCELERATE_USE_CPU) and fsdp.yaml as N independent
    copies with no error; the loop must refuse instead of training N unsynchronised heads."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine these configs do synchronise")
    rc, text = finish(_launch(accel_config, tmp_path / "run", _env()), timeout=300)
    assert rc != 0, text[-2000:]
    assert message in text and "ACCELERATE_USE_CPU=1" in text, text[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_check_launch_names_what_accelerate_changed() -> None:
    """What `accelerate launch` asked for (its environment) against what accelerate chose."""
    from accelerate.utils import DistributedType as D

    from train.errors import TrainError
    from train.launch import check_launch

    ds, fsdp = {"ACCELERATE_USE_DEEPSPEED": "true"}, {"ACCELERATE_USE_FSDP": "true"}
    check_launch(D.NO, env={})  # plain single process
    check_launch(D.MULTI_CPU, env={"WORLD_SIZE": "2"})  # ddp.yaml + ACCELERATE_USE_CPU=1
    check_launch(D.DEEPSPEED, env={**ds, "WORLD_SIZE": "2"})
    check_launch(D.FSDP, env={**fsdp, "WORLD_SIZE": "8"})
    with pytest.raises(TrainError, match="asks for DeepSpeed, but accelerate runs MULTI_CPU: unset ACCELERATE_USE_CPU"):
        check_launch(D.MULTI_CPU, env={**ds, "WORLD_SIZE": "2"})
    with pytest.raises(TrainError, match="asks for FSDP, but accelerate runs MULTI_CPU"):
        check_launch(D.MULTI_CPU, env={**fsdp, "WORLD_SIZE": "2"})
    with pytest.raises(TrainError, match="^2 processes were started, but accelerate runs them unsynchronised"):
        check_launch(D.NO, env={"WORLD_SIZE": "2"})


FSDP_SCRIPT = """
import json, sys, types
import torch
torch.distributed.init_process_group("gloo")
from accelerate.utils import DistributedType
from data.config import RunConfig
from data.features import forward_features
from data.target import load_model
from train.placement import layer_param_counts, load_frozen_target

rank = torch.distributed.get_rank()
cfg = RunConfig()
cfg.target.name_or_path = "tiny-random-llama"
ref = load_model(cfg.target)
# accelerate only selects FSDP with GPUs; this stands in for its Accelerator (what load_frozen_target reads).
acc = types.SimpleNamespace(device=torch.device("cpu"), distributed_type=DistributedType.FSDP,
                            state=types.SimpleNamespace())
frozen = load_frozen_target(cfg, acc, online=True)
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, 200, (2, 12), generator=g)
mask = torch.ones_like(ids)
mask[1, :4] = 0  # left padding in the second row
diffs = []
for _ in range(2):  # the second forward runs on resharded layers
    a, _ = forward_features(frozen.model, ids, mask, [1, 2])
    b, _ = forward_features(ref, ids, mask, [1, 2])
    diffs += [float((a.last - b.last).abs().max()), float((a.aux - b.aux).abs().max())]
full, local = layer_param_counts(frozen.model)  # after the forwards: still sharded?
io_plain = all(not hasattr(p, "to_local") for m in (frozen.io.embed, frozen.io.lm_head, frozen.io.norm,
                                                    frozen.io.last_layer) for p in m.parameters())
x = torch.randn(2, 5, 64, generator=g, requires_grad=True)
frozen.io.lm_head(frozen.io.norm(x)).logsumexp(-1).sum().backward()
json.dump({"placement": frozen.placement, "stats": frozen.stats(), "diffs": diffs, "full": full, "local": local,
           "io_plain": io_plain, "grad_ok": bool(x.grad is not None and x.grad.abs().sum() > 0)},
          open(sys.argv[1] + f"/rank{rank}.json", "w"))
torch.distributed.destroy_process_group()
"""


@pytest.mark.distributed
def test_fsdp_target_placement_shards_layers_and_keeps_features(tmp_path: Path) -> None:
    """train/placement.py under FSDP (2 gloo processes): every decoder layer is a FSDP2 unit holding half of
    its weights on each rank, before and after forwards, and the features equal the whole model's."""
    script = tmp_path / "fsdp_target.py"
    script.write_text(FSDP_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(tmp_path)]
    _finish(start(cmd, cwd=REPO, env=_env()), "FSDP placement script", timeout=300)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for row in rows:
        assert row["placement"] == "fsdp" and row["stats"]["target_placement"] == "fsdp"
        assert max(row["diffs"]) <= 1e-6, row["diffs"]
        assert row["local"] * 2 == row["full"] == 147968, row  # the tiny Llama's 2 layers, split in two
        assert row["io_plain"] and row["grad_ok"]


def test_launcher_configs_parse_and_say_what_they_shard() -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {"ddp.yaml": ("MULTI_GPU", None), "deepspeed_zero2.yaml": ("DEEPSPEED", 2),
                "deepspeed_zero3.yaml": ("DEEPSPEED", 3), "fsdp.yaml": ("FSDP", None)}
    assert sorted(p.name for p in ACCEL.glob("*.yaml")) == sorted(expected)
    for name, (dist, stage) in expected.items():
        cfg = load_config_from_file(str(ACCEL / name))  # accelerate's own loader: refuses unknown keys
        assert str(cfg.distributed_type).endswith(dist), name
        raw = yaml.safe_load((ACCEL / name).read_text())
        if stage is not None:
            ds_file = REPO / raw["deepspeed_config"]["deepspeed_config_file"]
            ds = json.loads(ds_file.read_text())
            assert ds["zero_optimization"]["stage"] == stage, ds_file
            # The loop fills these from the run config; a number here would silently override it.
            for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
                assert ds[key] == "auto", f"{ds_file}: {key}"
            # accelerate can only fill hidden-size-based "auto" entries from a transformers model; heads
            # are plain modules, so those must be numbers.
            assert "auto" not in json.dumps(ds["zero_optimization"]), ds_file
            # Says what happens to a transformers model built under the config (train/placement.py
            # decides the target's placement itself either way).
            assert raw["deepspeed_config"]["zero3_init_flag"] is (stage == 3), name
        if dist == "FSDP":
            assert raw["fsdp_config"]["fsdp_version"] == 2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("accel_config", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_deepspeed_zero_on_cpu_matches_ddp(tmp_path: Path, accel_config: str) -> None:
    """ZeRO-2/3 over gloo on CPU train the same head as DDP (needs the `deepspeed` extra; the first run
    compiles DeepSpeed's CPU comm extension, about 1-5 minutes)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("this test needs the deepspeed extra: pip install -e '.[deepspeed]'")
    ddp, zero = tmp_path / "ddp", tmp_path / "zero"
    procs = [(_launch("ddp.yaml", ddp, _env(ACCELERATE_USE_CPU="1")), "DDP run"),
             # No ACCELERATE_USE_CPU here: with it accelerate silently drops DeepSpeed for plain CPU DDP.
             (_launch(accel_config, zero, _env()), f"{accel_config} run")]
    texts = {what: _finish(proc, what, timeout=900) for proc, what in procs}
    # With deepspeed installed, as here, DDP runs import it too (accelerate's unwrap_model does).
    _assert_groups_ended(texts["DDP run"], "DDP run")
    if accel_config == "deepspeed_zero2.yaml":
        # Under ZeRO-3 DeepSpeed keeps its engine, and the groups with it, until exit (train/launch.py).
        _assert_groups_ended(texts[f"{accel_config} run"], f"{accel_config} run")
    world_d, loss_d = _metrics(ddp)
    world_z, loss_z = _metrics(zero)
    assert world_d == world_z == 2
    # With ZeRO-3 the target computes the features sharded; the same losses mean the same features.
    assert loss_z == pytest.approx(loss_d, rel=1e-4, abs=1e-5)
    pd, pz = _placement(ddp), _placement(zero)
    assert (pd.pop("distributed_type"), pz.pop("distributed_type")) == ("MULTI_CPU", "DEEPSPEED")
    assert pd["target_placement"] == "replicated" and pd["target_layer_params_local"] == pd["target_layer_params"]
    assert pz["target_layer_params"] == pd["target_layer_params"] > 0
    if accel_config == "deepspeed_zero2.yaml":
        d = _digests(zero)
        assert len(d) == 2 and d[0] == d[1], "ZeRO-2 replicates parameters: both ranks must hold the same head"
        assert pz == pd, "ZeRO-2 replicates the frozen target"
    else:
        # Each of the 2 ranks stores its half of every decoder-layer weight (partitions are padded to
        # an even split, hence the small slack).
        assert pz["target_placement"] == "zero3"
        full, local = int(pz["target_layer_params"]), int(pz["target_layer_params_local"])
        assert full / 2 <= local <= full / 2 + 64, pz
    # Under ZeRO-3 each rank holds a shard; the head folder must still hold the full gathered weights.
    _assert_heads_close(ddp, zero, atol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_mtp_resume_matches_uninterrupted(tmp_path: Path) -> None:
    """ZeRO-3 with the MTP head (its block is a copy of the target's last layer, taken from the partitioned
    target): 4 steps straight vs 2 steps, stop, --resume auto for the rest log the same losses."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("this test needs the deepspeed extra: pip install -e '.[deepspeed]'")
    args = ["--config", str(REPO / "configs" / "tiny-mtp.yaml"), "--train.max_steps=4", "--train.batch_size=2",
            "--data.max_samples=24", "--train.log_every=1", "--train.eval_every=1000", "--train.checkpoint_every=2",
            "--optim.warmup_steps=5"]

    def launch(out: Path, *extra: str) -> subprocess.Popen:
        return _launch("deepspeed_zero3.yaml", out, _env(), [*args, *extra], entry="mtp.py")

    straight, split = tmp_path / "straight", tmp_path / "split"
    _finish(launch(straight), "uninterrupted ZeRO-3 MTP run", timeout=900)
    _finish(launch(split, "--train.max_steps=2"), "first half", timeout=900)
    # All 4 steps lie in the warmup (optim.warmup_steps=5), so stopping the first half by max_steps=2 does
    # not change its learning rates; the resumed half restores optimizer, scheduler and RNG state.
    # DeepSpeed writes its checkpoint with pickle: resuming it is an explicit act of trust.
    _finish(launch(split, "--resume", "auto", "--trust-checkpoint"), "resumed half", timeout=900)

    def losses(out: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["event"] == "train"}

    a, b = losses(straight), losses(split)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [1, 2, 3, 4]
    assert [b[s] for s in (1, 2, 3, 4)] == pytest.approx([a[s] for s in (1, 2, 3, 4)], rel=1e-5, abs=1e-6)
    assert _placement(split)["target_placement"] == "zero3"


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_keep_best_writes_head_best_from_rank_0_at_the_best_evaluation(tmp_path: Path) -> None:
    """train.keep_best under 2-process DDP: writing OUT/head_best gathers the weights on every rank (no rank
    waits alone), and its step is the evaluation with the highest held-out tau_sim (the first, on ties)."""
    out = tmp_path / "best"
    args = [*RUN_ARGS, "--train.keep_best=true", "--train.eval_every=1"]
    _finish(_launch("ddp.yaml", out, _env(ACCELERATE_USE_CPU="1"), args), "DDP run with train.keep_best")
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "eval"]
    top = max(r["eval/tau_sim"] for r in evals)
    step = next(r["step"] for r in evals if r["eval/tau_sim"] == top)
    extra = json.loads((out / "head_best" / "config.json").read_text())["extra"]
    assert (extra["best_step"], extra["best_tau_sim"]) == (step, top)
    assert len(set(_digests(out))) == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_resume_matches_uninterrupted(tmp_path: Path) -> None:
    """2-process DDP: 4 steps straight vs 2 steps, then --resume auto, log the same losses; the checkpoint
    holds the head as safetensors and the rest in weights_only .pt files (every rank's RNG state included),
    so no --trust-checkpoint."""
    args = [*RUN_ARGS, "--train.max_steps=4", "--optim.warmup_steps=5", "--train.checkpoint_every=2"]
    env = _env(ACCELERATE_USE_CPU="1")
    straight, split = tmp_path / "straight", tmp_path / "split"
    _finish(_launch("ddp.yaml", straight, env, args), "uninterrupted DDP run")
    _finish(_launch("ddp.yaml", split, env, [*args, "--train.max_steps=2"]), "first half")
    ckpt = split / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "progress.json", "rng.rank0.pt",
                                                      "rng.rank1.pt", "state.pt"]
    _finish(_launch("ddp.yaml", split, env, [*args, "--resume", "auto"]), "resumed half")
    a = {r["step"]: r["loss"] for r in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())
         if r["event"] == "train"}
    b = {r["step"]: r["loss"] for r in map(json.loads, (split / "metrics.jsonl").read_text().splitlines())
         if r["event"] == "train"}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], rel=1e-5, abs=1e-6)
    assert _digests(straight) == _digests(split)


def test_device_map_target_refused_in_training() -> None:
    """A device map scatters the embedding and lm_head the heads call over GPUs; the loop refuses it and
    says to shard with ZeRO-3 / FSDP instead (the map is for extraction)."""
    import types

    from data.config import ConfigError, RunConfig
    from train.placement import load_frozen_target

    cfg = RunConfig()
    cfg.target.name_or_path, cfg.target.device_map = "tiny-random-llama", "auto"
    acc = types.SimpleNamespace(num_processes=2, device=torch.device("cpu"), state=types.SimpleNamespace())
    with pytest.raises(ConfigError, match=r"target.device_map 'auto' is for extraction .* ZeRO-3 or FSDP"):
        load_frozen_target(cfg, acc, online=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_real_target_matches_ddp(tmp_path: Path) -> None:
    """The packaged SmolLM2-135M (a real checkpoint, which transformers loads partitioned under ZeRO-3)
    computes the same features sharded as replicated: 2-process ZeRO-3 and DDP log the same losses."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("this test needs the deepspeed extra: pip install -e '.[deepspeed]'")
    args = ["--config", str(REPO / "configs" / "smollm2-135m.yaml"),
            "--data.path=data/bundled/tiny_conversations.jsonl", "--data.max_samples=24",
            "--head.draft_vocab_size=256", "--features.mode=online", "--train.max_steps=2", "--train.batch_size=2",
            "--train.log_every=1", "--train.eval_every=1000", "--train.eval_at_end=false",
            "--train.mixed_precision=no"]  # the recipe's bf16 autocast would round both streams apart

    ddp, zero = tmp_path / "ddp", tmp_path / "zero"
    procs = [(_launch("ddp.yaml", ddp, _env(ACCELERATE_USE_CPU="1"), args), "DDP run"),
             (_launch("deepspeed_zero3.yaml", zero, _env(), args), "ZeRO-3 run")]
    for proc, what in procs:
        _finish(proc, what, timeout=900)

    def losses(out: Path) -> list[float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["event"] == "train"]

    assert len(losses(ddp)) == 2
    assert losses(zero) == pytest.approx(losses(ddp), rel=1e-4)
    pz = _placement(zero)
    assert pz["target_placement"] == "zero3"
    assert pz["target_layer_params"] / 2 <= pz["target_layer_params_local"] <= pz["target_layer_params"] / 2 + 1000
