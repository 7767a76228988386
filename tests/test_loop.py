"""The shared training loop: tiny end-to-end runs, exact resume after SIGTERM, data plan, schedule, CLI errors.

    .venv/bin/python -m pytest -q tests/test_loop.py
"""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

import train.loop as train_loop
from data.config import load_config
from heads.base import load_head
from heads.losses import chain_metrics
from train.batches import Plan, make_plan, train_loader
from train.errors import TrainError
from train.loop import main, train
from train.metrics import MetricSum, simulated_tau
from train.schedule import lr_factor


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tok-cache")


def _cfg(path, out, cache, **over):
    flags = {"train.max_steps": 6, "train.batch_size": 2, "train.log_every": 1, "train.eval_every": 3,
             "train.checkpoint_every": 100, "data.cache_dir": str(cache), "optim.warmup_steps": 2, **over}
    cfg = load_config(path, [f"--{k}={v}" for k, v in flags.items()])
    cfg.out = str(out)
    return cfg


def _rows(out, event):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == event]


@pytest.mark.parametrize("config", ["configs/tiny-eagle.yaml", "configs/tiny-eagle1.yaml"])
def test_tiny_run_leaves_a_loadable_head_and_metrics(tmp_path, cache_dir, tiny_target, config):
    res = train(_cfg(config, tmp_path / "run", cache_dir))
    out = tmp_path / "run"
    assert (out / "head" / "config.json").is_file() and (out / "head" / "model.safetensors").is_file()
    assert (out / "config.yaml").is_file() and (out / "final_params_digest.rank0.txt").is_file()
    start, evals, end = _rows(out, "start")[0], _rows(out, "eval"), _rows(out, "end")[0]
    assert start["world_size"] == 1 and start["global_batch_size"] == 2 and end["step"] == 6
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert len(_rows(out, "train")) == 6 and all(r["tokens_per_s"] > 0 for r in _rows(out, "train"))
    cfg = load_config(config)  # the lr logged after step s is the one step s+1 runs with (the library schedule)
    assert [r["lr"] for r in _rows(out, "train")] == pytest.approx(
        [cfg.optim.lr * lr_factor(s, 2, 6, cfg.optim.min_lr_ratio) for s in range(1, 7)])
    # a few steps already beat the untrained head on held-out top-1 (the simulated tau follows)
    assert evals[-1]["eval/top1/0"] > evals[0]["eval/top1/0"]
    assert evals[-1]["eval/tau_sim"] == pytest.approx(res["eval"]["tau_sim"])
    _, cfg, meta = load_head(out / "head", tiny_target[2])
    assert meta["extra"]["step"] == 6 and cfg.family == ("eagle1" if "eagle1" in config else "eagle3")
    assert not (out / "head_best").exists() and not _rows(out, "best")  # train.keep_best is opt-in


def test_stop_by_sigterm_then_resume_matches_an_uninterrupted_run(tmp_path, cache_dir, capsys):
    full = train(_cfg("configs/tiny-eagle.yaml", tmp_path / "a", cache_dir))

    def preempt(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg_b = _cfg("configs/tiny-eagle.yaml", tmp_path / "b", cache_dir)
    stopped = train(cfg_b, on_step=preempt)
    assert stopped["stopped"] and stopped["step"] == 3
    assert "stopped by signal; state saved to" in capsys.readouterr().out
    assert not (tmp_path / "b" / "final_params_digest.rank0.txt").exists()
    ckpt = tmp_path / "b" / "checkpoints" / "step-00000003"  # weights_only state, the scheduler's position included
    assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "progress.json", "rng.rank0.pt", "state.pt"]
    assert json.loads((ckpt / "progress.json").read_text())["scheduler"]["last_epoch"] == 3
    resumed = train(cfg_b, resume="auto")
    assert resumed["step"] == 6 and not resumed["stopped"]
    a = {r["step"]: r["loss"] for r in _rows(tmp_path / "a", "train")}
    b = {r["step"]: r["loss"] for r in _rows(tmp_path / "b", "train")}
    assert sorted(b) == sorted(a) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    assert resumed["digest"] == full["digest"]


def test_keep_best_keeps_the_peak_step_and_a_resume_keeps_it(tmp_path, cache_dir, tiny_target, monkeypatch):
    """train.keep_best with a held-out tau scripted to peak at the step-3 evaluation (of 0, 3, 6): OUT/head_best
    is the step-3 head, in an uninterrupted run and in one stopped at step 3 and resumed (which must not take
    the lower tau at step 6 for a new best, as it would if the resume forgot the best so far)."""
    taus = iter([1.0, 5.0, 2.0] * 2)  # the evaluations of run a, then those of run b and its resume

    class Scripted(MetricSum):
        def reduce(self, accelerator):
            return {**super().reduce(accelerator), "tau_sim": next(taus)}

    monkeypatch.setattr(train_loop, "MetricSum", Scripted)
    full = train(_cfg("configs/tiny-eagle.yaml", tmp_path / "a", cache_dir, **{"train.keep_best": "true"}))
    assert full["best"] == {"step": 3, "tau_sim": 5.0}
    assert [(r["step"], r["eval/tau_sim"]) for r in _rows(tmp_path / "a", "best")] == [(0, 1.0), (3, 5.0)]

    def preempt(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg_b = _cfg("configs/tiny-eagle.yaml", tmp_path / "b", cache_dir, **{"train.keep_best": "true"})
    train(cfg_b, on_step=preempt)
    ckpt = tmp_path / "b" / "checkpoints" / "step-00000003"
    assert json.loads((ckpt / "progress.json").read_text())["best"] == {"step": 3, "tau_sim": 5.0}
    resumed = train(cfg_b, resume="auto")
    assert resumed["best"] == {"step": 3, "tau_sim": 5.0} and resumed["digest"] == full["digest"]
    io = tiny_target[2]
    for run in ("a", "b"):
        best, _, meta = load_head(tmp_path / run / "head_best", io)
        assert (meta["extra"]["step"], meta["extra"]["best_step"], meta["extra"]["best_tau_sim"]) == (3, 3, 5.0)
        last, _, _ = load_head(tmp_path / run / "head", io)
        assert any(not torch.equal(a, b) for a, b in zip(best.state_dict().values(), last.state_dict().values()))
    a_best, b_best = (load_head(tmp_path / r / "head_best", io)[0].state_dict() for r in ("a", "b"))
    assert all(torch.equal(a_best[k], b_best[k]) for k in a_best)
    none_held_out = _cfg("configs/tiny-eagle.yaml", tmp_path / "c", cache_dir,
                         **{"train.keep_best": "true", "data.holdout_fraction": 0})
    with pytest.raises(TrainError, match="train.keep_best: no held-out conversations"):
        train(none_held_out)


def test_a_checkpoint_from_before_a_new_config_key_resumes(tmp_path, cache_dir):
    """Keys added to the schema later (here head.loss, head.norm_before_residual, train.keep_best) are absent
    from an older checkpoint's config: at their defaults they are no change, so the resume goes on; a new key
    set away from its default is a change (head.* is fixed on resume and refused by name)."""

    def preempt(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = _cfg("configs/tiny-eagle.yaml", tmp_path / "r", cache_dir)
    train(cfg, on_step=preempt)
    path = tmp_path / "r" / "checkpoints" / "step-00000003" / "progress.json"
    progress = json.loads(path.read_text())
    for section, key in (("head", "loss"), ("head", "norm_before_residual"), ("train", "keep_best")):
        del progress["config"][section][key]
    path.write_text(json.dumps(progress))
    tv = _cfg("configs/tiny-eagle.yaml", tmp_path / "r", cache_dir, **{"head.loss": "tv"})
    with pytest.raises(TrainError, match="cannot change head.loss"):
        train(tv, resume="auto")
    assert train(cfg, resume="auto")["step"] == 6
    assert _rows(tmp_path / "r", "resume")[-1]["changed"] == {}


def test_plan_gives_one_and_two_processes_the_same_global_batches():
    lengths = [5 + (i * 7) % 40 for i in range(37)]
    cfg = load_config("configs/tiny-eagle.yaml", ["--train.global_batch_size=4", "--train.batch_size=2"])
    one, two = make_plan(cfg, lengths, 1), make_plan(cfg, lengths, 2)
    assert (one.accum, two.accum) == (2, 1) and one.global_batch == two.global_batch == 4
    assert one.steps_per_epoch == two.steps_per_epoch == 9  # 19 micro-batches of 2 -> 9 steps of 4
    for step in range(2 * one.steps_per_epoch):
        single = one.micro_batches(step, 0)
        assert single == [two.micro_batches(step, 0)[0], two.micro_batches(step, 1)[0]]
    epoch0 = [i for s in range(9) for b in one.micro_batches(s, 0) for i in b]
    assert len(set(epoch0)) == len(epoch0)  # no sample twice within an epoch
    with pytest.raises(ValueError, match="not a multiple of train.batch_size 2 x 3 processes"):
        make_plan(cfg, lengths, 3)
    small = Plan(lengths, 2, 1, 1, 0, 1, 1)
    assert small.global_batch == 2


class _Samples:
    """A stand-in FeatureSet: batch(indices) holds the indices themselves."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def batch(self, indices):
        return {"idx": torch.tensor(indices), "attention_mask": torch.ones(len(indices), 3, dtype=torch.long)}


def test_loader_yields_the_plan_from_any_step_and_leaves_the_global_rng_alone():
    """The DataLoader's sampler starts at the resumed step (its position IS the step), and iterating it draws
    nothing from the global torch RNG (EAGLE-1's input noise draws from it: a resume must see the same stream)."""
    lengths = [5 + (i * 7) % 40 for i in range(37)]
    plan = make_plan(load_config("configs/tiny-eagle.yaml", ["--train.global_batch_size=4", "--train.batch_size=2",
                                                            "--train.max_steps=20"]), lengths, 2)
    for rank in (0, 1):
        want = [b for step in range(20) for b in plan.micro_batches(step, rank)]
        for start in (0, 7):
            torch.manual_seed(0)
            rng = torch.get_rng_state()
            got = [b["idx"].tolist() for b in train_loader(_Samples(lengths), plan, rank, start, torch.device("cpu"))]
            assert torch.equal(torch.get_rng_state(), rng)
            assert got == want[start * plan.accum:]


def test_lr_schedule_and_simulated_tau():
    assert [lr_factor(s, 2, 10, 0.1) for s in (0, 1)] == [0.5, 1.0]
    # transformers' cosine starts right after the last warmup step: 1/8 of its way at step 2
    assert lr_factor(2, 2, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 8)))
    assert lr_factor(9, 2, 10, 0.1) == pytest.approx(0.1)
    assert 0.1 < lr_factor(5, 2, 10, 0.1) < 1.0
    # tau_sim = 1 + a0 + a0*a1: 1 + 0.8 + 0.4
    assert simulated_tau([0.8, 0.5]) == pytest.approx(2.2)
    assert simulated_tau([]) == 1.0


class _OneProcess:
    """What MetricSum.reduce needs of an accelerator on one process."""

    num_processes = 1
    device = torch.device("cpu")


def test_chain_metrics_and_tau_chain_weigh_batches_by_their_start_positions():
    # worked example: chain/0 = 3/4, chain/1 = 2/4 (position 2 misses step 0; its step-1 hit does not count)
    got = chain_metrics([torch.tensor([1.0, 1, 0, 1]), torch.tensor([1.0, 0, 1, 1])], torch.ones(4))
    assert got == {"chain/0": 0.75, "chain/1": 0.5, "n/chain": 4.0}
    # two batches, 4 and 1 start positions: means over the 5 starts, not over the 2 batches
    sums = MetricSum()
    sums.add(1.0, {"top1/0": 0.75, "n/0": 4, "top1/1": 0.75, "n/1": 4, **got})
    sums.add(1.0, {"top1/0": 0.0, "n/0": 1, "top1/1": 1.0, "n/1": 1,
                   **chain_metrics([torch.tensor([0.0]), torch.tensor([1.0])], torch.ones(1))})
    res = sums.reduce(_OneProcess())
    assert res["chain/0"] == pytest.approx(3 / 5) and res["chain/1"] == pytest.approx(2 / 5)
    assert res["tau_chain"] == pytest.approx(2.0)
    # the independence product counts the hits that follow a miss: 1 + 0.6 + 0.6 * 0.8
    assert res["tau_sim"] == pytest.approx(2.08)
    eagle1 = MetricSum()
    eagle1.add(1.0, {"top1/0": 0.5, "n/0": 2})
    assert "tau_chain" not in eagle1.reduce(_OneProcess())  # EAGLE-1 reports no chain


def test_cli_refuses_another_family_and_a_too_large_draft_vocab(tmp_path, cache_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", "configs/tiny-eagle.yaml", "--out", str(tmp_path / "x")], family="medusa")
    assert e.value.code == 2
    assert "head.family is 'eagle3' but this script trains medusa" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--config", "configs/tiny-eagle.yaml", "--out", str(tmp_path / "y"), "--head.draft_vocab_size=250",
              f"--data.cache_dir={cache_dir}"], family=("eagle1", "eagle3"))
    assert e.value.code == 2
    assert "head.draft_vocab_size 250 is larger than the" in capsys.readouterr().err


def test_assistant_only_loss_false_trains_on_every_real_token_and_evaluates_the_assistants(tmp_path, cache_dir,
                                                                                          capsys):
    """train.assistant_only_loss false: the loss sees every real token's mask while training and the stored
    (assistant) mask in held-out evaluation; a run with it trains another head than the default; a family whose
    labels are the sequence's own tokens (MTP) is refused by name, exit 2 from the CLI."""
    seen = []

    def spy(head, batch, target):
        seen.append(batch["loss_mask"].clone())
        return torch.zeros(()), {}

    batch = {"attention_mask": torch.tensor([[1, 1, 1, 1, 0]]), "loss_mask": torch.tensor([[0, 0, 1, 1, 0]])}
    for assistant_only, want_train in ((True, [0, 0, 1, 1, 0]), (False, [1, 1, 1, 1, 0])):
        module = train_loop.LossModule(torch.nn.Linear(1, 1), spy, None, assistant_only)
        module.train()(batch)
        module.eval()(batch)
        assert seen[-2].tolist() == [want_train] and seen[-1].tolist() == [[0, 0, 1, 1, 0]], assistant_only
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0]]  # the caller's batch is left as it was

    default = train(_cfg("configs/tiny-eagle.yaml", tmp_path / "a", cache_dir))
    every = train(_cfg("configs/tiny-eagle.yaml", tmp_path / "b", cache_dir, **{"train.assistant_only_loss": "false"}))
    assert every["digest"] != default["digest"]
    assert _rows(tmp_path / "b", "train")[0]["loss"] != _rows(tmp_path / "a", "train")[0]["loss"]
    # held-out rows score the same (assistant) positions: the untrained heads' step-0 evaluations agree
    assert _rows(tmp_path / "b", "eval")[0]["eval/loss"] == _rows(tmp_path / "a", "eval")[0]["eval/loss"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--config", "configs/tiny-mtp.yaml", "--out", str(tmp_path / "m"), "--train.assistant_only_loss=false",
              f"--data.cache_dir={cache_dir}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.assistant_only_loss false: this mtp head's loss is labelled with" in err[0]


def test_eval_at_end_writes_the_report(tmp_path, cache_dir):
    """train.eval_at_end: the CLI trains, then evaluates the finished head with the exact decoder."""
    out = tmp_path / "run"
    flags = {"train.max_steps": 2, "train.batch_size": 2, "train.eval_every": 100, "train.checkpoint_every": 100,
             "data.cache_dir": str(cache_dir), "train.eval_at_end": "true", "eval.max_questions": 1,
             "eval.max_new_tokens": 8, "eval.batch_sizes": "[1, 2]"}
    res = main(["--config", "configs/tiny-eagle.yaml", "--out", str(out), *[f"--{k}={v}" for k, v in flags.items()]],
               family=("eagle1", "eagle3"))
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["benchmarks"]["mt_bench"]["tau"] >= 1.0
    assert res["report"]["benchmarks"]["mt_bench"]["tau"] == report["benchmarks"]["mt_bench"]["tau"]
