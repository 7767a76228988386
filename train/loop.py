"""The one training loop for every head family, run by accelerate.

    python -m train --config configs/tiny-eagle.yaml --out runs/tiny      # any family (train/__main__.py)
    python train/eagle.py --config configs/tiny-eagle.yaml --out runs/tiny  # the same, refusing non-EAGLE configs
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train/eagle.py --config C --out D
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml train/eagle.py --config C --out D
    python train/eagle.py --config C --out D --resume auto        # continue from D's latest checkpoint

Entry scripts call `main(argv, family=...)` (the family names they accept; none: any). The loop knows a
family only through its `heads.registry.Family`: `feature_layers`, `build`, `loss`, and, when the family has
one, `prepare(head_cfg, train_dataset, target) -> {name: tensor}` (initial values for data-derived head
tensors, e.g. a draft vocabulary mapping), loaded into the freshly built head; `reads(head_cfg)` says
whether batches carry the target's argmax (online features compute it only then).

The algorithm (`train`): prepare, then for each optimizer step: step, log, maybe evaluate, maybe save.
- prepare: the Accelerator (train/launch.py; `accelerate.utils.set_seed(seed)` once before anything
  random), the frozen target (train/placement.py), the datasets and their features (data.featureset), the
  plan of micro-batches (train/batches.py), the head, AdamW over the head's parameters only, the resumed
  checkpoint if any (train/checkpoint.py), the lr schedule (train/schedule.py).
- step: a torch DataLoader over the length-bucketing sampler (train/batches.py) assembles the
  micro-batches; the step runs world x grad_accum of them (grad_accum is optim.grad_accum, or
  train.global_batch_size / (batch_size x processes) when that is set, so `python train/eagle.py` and a
  2-process launch of the same config agree up to float summation order), each loss normalised within its
  micro-batch, gradients averaged over ranks (DDP) and rounds (accumulation); gradient clipping
  (optim.grad_clip); the scheduler steps once per optimizer step.
- log, on rank 0 only: tqdm (loss, tokens/s), OUT/metrics.jsonl (a `start` event with world_size,
  distributed_type, grad_accum, global_batch_size and the target's placement; a `resume` event listing
  changed config keys; `train` rows every train.log_every steps with loss averaged over all ranks; `eval`
  rows; an `end` event) and wandb in logging.wandb_mode (train/metrics.py). OUT/config.yaml: the
  resolved config.
- evaluate (`evaluate_holdout`): held-out loss, per-step top-1 and the simulated acceptance length
  (train/metrics.py) every train.eval_every steps, before the first step and at the end.
- keep the best (`keep_best`, train.keep_best only): after an evaluation whose held-out tau_sim beats every
  earlier one, OUT/head_best (OUT/head's format; `extra` records best_step and best_tau_sim), a `best` event
  in metrics.jsonl; the best so far goes into each checkpoint's progress.json, so a resume keeps it.
- save, every train.checkpoint_every steps and at the end: OUT/head (save_head, loadable alone) and
  OUT/checkpoints/step-NNNNNNNN (train/checkpoint.py: nothing in it runs on load, the two newest kept). `--resume
  PATH|auto` continues with the same data order, so a stopped-and-resumed run logs the losses of an
  uninterrupted one; resuming a finished run does nothing.
- SIGTERM or SIGUSR1 (train/signals.py): the step in flight finishes, all ranks agree, a checkpoint is
  written, `stopped by signal; state saved to DIR` is printed, and the process exits with code 0.
- At the end every rank writes OUT/final_params_digest.rank{R}.txt: the SHA-256 of the head parameters it
  holds (identical on all ranks under DDP or ZeRO-2); the `end` event carries rank 0's digest and the
  world size. Teardown (train/launch.py) then ends the process groups before the interpreter exits.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm

from data.cli import cli_main, write_atomic
from data.config import RunConfig, check_layer_ids, parse_args, save_config, to_dict
from data.featureset import FeatureSet, online_capture, open_featureset
from data.target import load_config_only, text_config
from data.tokenize import build_datasets
from eval.run import evaluate
from heads import registry
from heads.base import HeadMismatchError, TargetIO, check_finite, save_head
from heads.registry import TARGET_ARGMAX, Family
from train.batches import Plan, holdout_loader, make_plan, train_loader
from train.checkpoint import Resume, open_resume, restore, write_checkpoint
from train.errors import TrainError
from train.launch import apply_plan, claim_run_folder, make_accelerator, teardown
from train.metrics import MetricsLog, MetricSum, TrainWindow, format_eval
from train.placement import FrozenTarget, load_frozen_target
from train.schedule import make_scheduler
from train.signals import StopSignals


class LossModule(nn.Module):
    """The head plus its family's loss as one module, so DDP/DeepSpeed/FSDP wrap a forward that returns
    (loss, metrics). The frozen target is held as a plain attribute: never trained, never saved."""

    def __init__(self, head: nn.Module, loss_fn: Callable, target: TargetIO, assistant_only_loss: bool = True):
        super().__init__()
        self.head = head
        self.loss_fn = loss_fn
        self.target = target
        self.assistant_only_loss = assistant_only_loss

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        if self.training and not self.assistant_only_loss:  # train.assistant_only_loss false: every real token
            batch = {**batch, "loss_mask": batch["attention_mask"]}
        return self.loss_fn(self.head, batch, self.target)


@dataclass
class Run:
    """One prepared training run: what every stage of the loop reads."""

    cfg: RunConfig
    accelerator: Accelerator
    family: Family
    frozen: FrozenTarget
    splits: tuple[datasets.Dataset, datasets.Dataset]  # train, held-out (tokenized)
    train_fs: FeatureSet
    hold_fs: FeatureSet | None
    plan: Plan
    model: nn.Module  # LossModule, as accelerator.prepare returned it
    optimizer: Any
    scheduler: LRScheduler
    resume: Resume
    start: int  # optimizer steps already done (by the resumed checkpoint)
    log: MetricsLog
    best: dict[str, Any] | None = None  # train.keep_best: {"step", "tau_sim"} of OUT/head_best, once written

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def target(self) -> TargetIO:
        return self.frozen.io

    @property
    def main_proc(self) -> bool:
        return self.accelerator.is_main_process


# ----------------------------------------------------------------------------------------------- the algorithm
def train(cfg: RunConfig, resume: str | None = None, on_step: Callable[[int], None] | None = None,
          trust_checkpoint: bool = False) -> dict[str, Any]:
    """Train cfg.head on cfg.data; returns a summary (final held-out metrics, steps, out folder).

    `resume`: a checkpoint folder, or "auto" (the newest sound one in OUT/checkpoints, if any). A changed
    config key is applied and logged (a `resume` event) or refused (FIXED_ON_RESUME). `trust_checkpoint`
    allows checkpoints holding pickle files (DeepSpeed/FSDP, older runs). `on_step(step)` is called on
    every rank after each optimizer step (used by tests to deliver a signal at a known step).
    """
    # Before anything heavy: the checkpoint is sound, the config changes are ones a resume can apply,
    # the layer ids fit the target (read from its config before any weight loads).
    with claim_run_folder(cfg.out, resume):
        checkpoint = open_resume(cfg, resume, trust_checkpoint)
        check_layer_ids(cfg, text_config(load_config_only(cfg.target)))
        accelerator = make_accelerator(cfg)
        try:
            with StopSignals() as stop:
                # The Run (and the DDP/DeepSpeed model it holds) lives only in _prepare_and_fit's frame, so it
                # is gone when teardown ends the process groups (train/launch.py says why that order matters).
                return _prepare_and_fit(cfg, accelerator, checkpoint, stop, on_step)
        finally:
            teardown(accelerator)


def _prepare_and_fit(cfg: RunConfig, accelerator: Accelerator, checkpoint: Resume, stop: StopSignals,
                     on_step: Callable[[int], None] | None) -> dict[str, Any]:
    run = prepare(cfg, accelerator, checkpoint)
    if checkpoint.ckpt is not None and run.start >= run.plan.total_steps:
        return already_finished(run)
    log_start(run)
    return fit(run, stop, on_step)


def fit(run: Run, stop: StopSignals, on_step: Callable[[int], None] | None) -> dict[str, Any]:
    """From run.start to the last optimizer step: step, log, maybe evaluate, maybe save (or stop)."""
    cfg, total = run.cfg.train, run.plan.total_steps
    last_eval = evaluate_holdout(run, 0) if run.start == 0 else {}
    run.model.train()
    batches = iter(train_loader(run.train_fs, run.plan, run.accelerator.process_index, run.start,
                                run.accelerator.device))
    bar = tqdm(total=total, initial=run.start, disable=not run.main_proc, desc=f"train {run.cfg.head.family}",
               unit="step", dynamic_ncols=True)
    window, step, stopped, loss_value = TrainWindow(), run.start, None, float("nan")
    try:  # an error mid-run must not print its one line onto the progress bar
        for step in range(run.start + 1, total + 1):  # `step` optimizer steps done after this one
            train_step(run, islice(batches, run.plan.accum), window)
            if on_step is not None:
                on_step(step)
            if step % cfg.log_every == 0 or step == total:
                loss_value = log_train(run, step, window, bar)
                window = TrainWindow()
            bar.update(1)
            if step % cfg.eval_every == 0 and step < total:
                last_eval = evaluate_holdout(run, step)
            if stop.requested(run.accelerator) and step < total:  # a collective: every rank asks every step
                stopped = save_checkpoint(run, step)
                break
            if step % cfg.checkpoint_every == 0 and step < total:
                save_checkpoint(run, step)
    finally:
        bar.close()
    if stopped is not None:
        return stop_here(run, step, stopped)
    return finish(run, step, last_eval, loss_value)


def train_step(run: Run, micro_batches: Iterable[dict[str, torch.Tensor]], window: TrainWindow) -> None:
    """One optimizer step over this rank's accumulation rounds (accelerate steps on the last one)."""
    acc, model, clip = run.accelerator, run.model, run.cfg.optim.grad_clip
    for batch in micro_batches:
        tokens = int(batch["attention_mask"].sum())
        with acc.accumulate(model):
            loss, m = model(batch)
            acc.backward(loss)
            # DeepSpeed clips inside its engine (gradient_clipping, train/launch.py)
            if acc.sync_gradients and clip > 0 and acc.distributed_type != DistributedType.DEEPSPEED:
                acc.clip_grad_norm_(model.parameters(), clip)
            run.optimizer.step()
            run.optimizer.zero_grad()
        window.add(float(loss.detach()), m, tokens)
    run.scheduler.step()


def log_train(run: Run, step: int, window: TrainWindow, bar: tqdm) -> float:
    """A `train` row (loss averaged over ranks, lr of the next step, tokens/s); returns the loss."""
    row = window.row(run.accelerator)
    run.log.write({"event": "train", "step": step, "lr": run.scheduler.get_last_lr()[0], **row})
    bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
    return row["loss"]


def evaluate_holdout(run: Run, step: int) -> dict[str, float]:
    """Held-out mean loss, per-step top-1 and tau_sim over all ranks; printed and logged as an `eval` row."""
    if run.hold_fs is None:
        return {}
    loader, weights = holdout_loader(run.hold_fs, run.plan, run.accelerator.process_index, run.accelerator.device)
    sums = MetricSum()
    run.model.eval()
    with torch.no_grad():
        for batch, weight in zip(loader, weights):
            loss, m = run.model(batch)
            sums.add(float(loss), m, weight)
    run.model.train()
    res = sums.reduce(run.accelerator)
    if run.main_proc:
        print(format_eval(step, res), flush=True)
    run.log.write({"event": "eval", "step": step, **{f"eval/{k}": v for k, v in res.items()}})
    keep_best(run, step, res)
    return res


def keep_best(run: Run, step: int, res: dict[str, float]) -> None:
    """train.keep_best: OUT/head_best when this evaluation's held-out tau_sim beats the best so far (strictly).

    Runs on every rank: write_head gathers the weights (a collective), and every rank holds the same
    reduced `res`, so all of them decide alike."""
    tau = res.get("tau_sim")
    if not run.cfg.train.keep_best or tau is None or (run.best is not None and tau <= run.best["tau_sim"]):
        return
    run.best = {"step": step, "tau_sim": tau}
    write_head(run, step, "head_best", {"best_step": step, "best_tau_sim": tau})
    run.log.write({"event": "best", "step": step, "eval/tau_sim": tau})


# ----------------------------------------------------------------------------------------------- prepare
def prepare(cfg: RunConfig, accelerator: Accelerator, checkpoint: Resume) -> Run:
    """Everything a run needs before its first step (see the module docstring), resumed if asked."""
    set_seed(cfg.seed)
    # Gradients through the softmax underflow into subnormal floats, which x86 CPUs compute on a microcoded slow
    # path: the quickstart's EAGLE-3 run (forward KL) went from 1.05 to 2.5 s a step after step 35, and its last
    # 32 steps took 74 s unflushed against 46 s flushed, to the same params digest (TV: 6 s a step by step 40,
    # 1.1 s flushed). So every run flushes them (docs/experiments.md).
    torch.set_flush_denormal(True)
    out = Path(cfg.out)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    family = registry.get(cfg.head.family)
    if not cfg.train.assistant_only_loss and not family.target_labels(cfg.head):
        raise TrainError(f"train.assistant_only_loss false: this {family.name} head's loss is labelled with the "
                         "sequence's own tokens, which on a prompt position are the user's, not the target's: keep "
                         "it true, or train the head against the target's distribution where its config can")
    frozen = load_frozen_target(cfg, accelerator, online=cfg.features.mode == "online")
    checkpoint.check_target(frozen.io)  # the same weights as the run that wrote the checkpoint
    if accelerator.is_main_process:
        save_config(cfg, out)  # after the resume checks: config.yaml says what runs
    with accelerator.main_process_first():
        train_ds, hold_ds = build_datasets(cfg, frozen.tokenizer)
    layer_ids = list(family.feature_layers(cfg.head, frozen.io.config))
    pad_id = frozen.tokenizer.pad_token_id if frozen.tokenizer.pad_token_id is not None else 0
    argmax = TARGET_ARGMAX in family.reads(cfg.head)
    capture = online_capture(cfg, frozen.model, layer_ids, train_ds, accelerator.process_index)
    train_fs = open_featureset(cfg, train_ds, frozen.model, layer_ids, "train", pad_id, target=frozen.io,
                               with_argmax=argmax, capture=capture)
    hold_fs = open_featureset(cfg, hold_ds, frozen.model, layer_ids, "holdout", pad_id, target=frozen.io,
                              with_argmax=argmax, capture=capture) if len(hold_ds) else None
    if cfg.train.keep_best and hold_fs is None:
        raise TrainError("train.keep_best: no held-out conversations to pick the best head by "
                         "(raise data.holdout_fraction)")
    plan = make_plan(cfg, train_fs.lengths, accelerator.num_processes)
    head = build_head(cfg, family, train_ds, frozen.io)
    adamw = torch.optim.AdamW(head.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                              weight_decay=cfg.optim.weight_decay)
    apply_plan(accelerator, plan, cfg)
    model, optimizer = accelerator.prepare(LossModule(head, family.loss, frozen.io, cfg.train.assistant_only_loss), adamw)
    start = restore(checkpoint, accelerator, model, optimizer, plan, cfg)
    # On the plain AdamW (that accelerate and DeepSpeed step): the schedule at `start` of THIS config.
    scheduler = make_scheduler(adamw, cfg, plan.total_steps, start)
    if checkpoint.ckpt is not None and accelerator.is_main_process:
        print(f"resumed from {checkpoint.ckpt} at step {start}")
    best = checkpoint.progress.get("best") if cfg.train.keep_best else None
    return Run(cfg, accelerator, family, frozen, (train_ds, hold_ds), train_fs, hold_fs, plan, model, optimizer,
               scheduler, checkpoint, start, MetricsLog(cfg, out, accelerator.is_main_process), best)


def build_head(cfg: RunConfig, family: Family, train_ds: datasets.Dataset, target: TargetIO) -> nn.Module:
    """A fresh head of cfg.head, with the family's data-derived initial tensors (its `prepare`) loaded."""
    try:
        init = family.prepare(cfg.head, train_ds, target) if family.prepare is not None else {}
        head = family.build(cfg.head, target)
    except HeadMismatchError:
        raise
    except ValueError as e:
        raise TrainError(f"head ({cfg.head.family}): {e}") from None
    if init:
        state = head.state_dict()
        for k, v in init.items():
            if k not in state or state[k].shape != v.shape:
                raise TrainError(f"{cfg.head.family}.prepare gave '{k}' {tuple(v.shape)}, which the head does not have")
        head.load_state_dict(init, strict=False)
    return head


def log_start(run: Run) -> None:
    """The `start` event (and a `resume` event with the changed config keys) in metrics.jsonl."""
    acc, plan, ckpt = run.accelerator, run.plan, run.resume.ckpt
    run.log.write({"event": "start", "family": run.cfg.head.family, "world_size": acc.num_processes,
                   "distributed_type": str(acc.distributed_type.value), "grad_accum": plan.accum,
                   "per_process_batch": plan.batch_size, "global_batch_size": plan.global_batch,
                   "steps_per_epoch": plan.steps_per_epoch, "total_steps": plan.total_steps,
                   "train_conversations": len(run.splits[0]), "holdout_conversations": len(run.splits[1]),
                   "features": run.cfg.features.mode, **run.frozen.stats(),
                   "resumed_from": str(ckpt) if ckpt else None, "start_step": run.start})
    if ckpt is not None:
        run.log.write({"event": "resume", "step": run.start, "checkpoint": str(ckpt), "changed": run.resume.changes})


# ----------------------------------------------------------------------------------------------- save and end
def write_head(run: Run, step: int, folder: str = "head", extra: dict[str, Any] | None = None) -> None:
    """OUT/head (or OUT/`folder`, with `extra` added to its config's extra): the head's weights gathered
    from every rank (a collective), written by rank 0."""
    state = run.accelerator.get_state_dict(run.model)
    if not run.main_proc:
        return
    fresh = run.family.build(run.cfg.head, run.target)
    weights = {k.removeprefix("head."): v for k, v in state.items()}
    check_finite(weights, f"step {step}")
    fresh.load_state_dict(weights)
    save_head(run.out / folder, fresh, run.cfg.head, run.target,
              extra={"step": step, "data": run.cfg.data.path, "features": run.cfg.features.mode,
                     "global_batch_size": run.plan.global_batch, **(extra or {})})


def save_checkpoint(run: Run, step: int) -> Path:
    """OUT/checkpoints/step-NNNNNNNN and OUT/head (all ranks)."""
    record = {"step": step, "global_batch": run.plan.global_batch, "world_size": run.accelerator.num_processes,
              "config": to_dict(run.cfg), "target": run.target.record(),
              **({"best": run.best} if run.best is not None else {})}
    return write_checkpoint(run.out / "checkpoints" / f"step-{step:08d}", run.accelerator, run.model,
                            run.optimizer, run.scheduler, lambda: write_head(run, step), record)


def finish(run: Run, step: int, last_eval: dict[str, float], loss_value: float) -> dict[str, Any]:
    """The last checkpoint and evaluation, every rank's parameter digest, the `end` event."""
    save_checkpoint(run, step)
    last_eval = evaluate_holdout(run, step) or last_eval
    rank, world = run.accelerator.process_index, run.accelerator.num_processes
    digest = params_digest(run.accelerator.unwrap_model(run.model))
    write_atomic(run.out / f"final_params_digest.rank{rank}.txt", digest + "\n")
    best = {"best": run.best} if run.best is not None else {}
    run.log.write({"event": "end", "step": step, "world_size": world, "params_digest": digest,
                   "final_train_loss": loss_value, **{f"eval/{k}": v for k, v in last_eval.items()}, **best})
    run.log.close()
    if run.main_proc:
        print(f"head saved to {run.out / 'head'}; metrics in {run.out / 'metrics.jsonl'}", flush=True)
        if run.best is not None:
            print(f"best held-out simulated tau {run.best['tau_sim']:.3f} at step {run.best['step']}: "
                  f"{run.out / 'head_best'}", flush=True)
    return {"out": str(run.out), "step": step, "stopped": False, "eval": last_eval, "train_loss": loss_value,
            "digest": digest, "world_size": world, **best}


def stop_here(run: Run, step: int, checkpoint: Path) -> dict[str, Any]:
    """After a stop signal: the run's state is in `checkpoint`; a `stopped` event, exit code 0."""
    if run.main_proc:
        print(f"stopped by signal; state saved to {checkpoint}", flush=True)
    run.log.write({"event": "stopped", "step": step, "checkpoint": str(checkpoint)})
    run.log.close()
    return {"out": str(run.out), "step": step, "stopped": True, "checkpoint": str(checkpoint)}


def already_finished(run: Run) -> dict[str, Any]:
    """A resume of a run that reached its last step: nothing is trained, written or logged."""
    if run.main_proc:
        print(f"{run.resume.ckpt}: this run already finished ({run.start} of {run.plan.total_steps} steps); "
              f"nothing to do (raise train.max_steps or train.epochs to train further)", flush=True)
    run.log.close()
    return {"out": str(run.out), "step": run.start, "stopped": False, "already_finished": True}


def params_digest(module: nn.Module) -> str:
    """SHA-256 of the parameters this process holds (its shard under ZeRO-3 / FSDP)."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard
        h.update(name.encode())
        h.update(t.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- CLI
@cli_main
def main(argv: list[str] | None = None, family: str | Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the common CLI (+ `--resume PATH|auto`, `--trust-checkpoint`), refuse another family's config, train."""

    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--resume", default=None,
                       help="checkpoint folder to continue from, or `auto` (the newest in OUT/checkpoints, if any)")
        p.add_argument("--trust-checkpoint", action="store_true",
                       help="allow resuming a checkpoint that holds pickle files (DeepSpeed/FSDP runs, older runs); "
                            "loading pickle can run code, so only for checkpoints you wrote yourself")

    cfg, args = parse_args("Train a drafter head (the shared loop).", argv, extra)
    allowed = (family,) if isinstance(family, str) else tuple(family or ())
    if allowed and cfg.head.family not in allowed:
        raise TrainError(f"{args.config or '<defaults>'}: head.family is '{cfg.head.family}' but this script trains "
                         f"{' / '.join(allowed)}")
    result = train(cfg, resume=args.resume, trust_checkpoint=args.trust_checkpoint)
    # train.eval_at_end: one process (rank 0) evaluates the finished head with the exact decoder.
    if cfg.train.eval_at_end and not result.get("stopped") and not result.get("already_finished") \
            and int(os.environ.get("RANK", "0")) == 0:
        result["report"] = evaluate(Path(result["out"]) / "head", cfg.eval, Path(result["out"]) / "eval",
                                    cfg.target, seed=cfg.seed)
    return result
