"""The learning-rate schedule: transformers' linear warmup + cosine to a floor, built at any step.

    scheduler = make_scheduler(optimizer, cfg, total_steps)               # a fresh run
    scheduler = make_scheduler(optimizer, cfg, total_steps, start=120)    # a resume at step 120
    lr_factor(step, warmup, total, min_ratio)       # the multiplier of optim.lr at optimizer step `step`

`transformers.get_cosine_with_min_lr_schedule_with_warmup_lr_rate`: for optimizer step s (0-based) of T,
with W = optim.warmup_steps, lr x (s+1)/W while s < W, then lr x (r + (1-r) x 0.5 (1 + cos(pi p))) with
p = (s-W+1)/(T-W) and r = optim.min_lr_ratio, so the last step runs at lr x r. (Of transformers'
schedulers this one matches the hand-written schedule this project had before, except that that one ran
the peak lr twice, at s = W-1 and s = W, and reached the floor over T-W-1 cosine steps: docs/experiments.md, "The lr schedule".)

The scheduler steps once per optimizer step (never scaled by the process count: it is not passed through
accelerator.prepare, whose wrapper would step it once per process). Its state is its step: a checkpoint
stores `scheduler.state_dict()` in its progress.json, and a resume rebuilds the schedule from THIS run's config at the
saved step (transformers' `last_epoch`), so a changed optim.lr or train.max_steps applies from there on.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_cosine_with_min_lr_schedule_with_warmup_lr_rate

from data.config import RunConfig


def _schedule(optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float, start: int) -> LambdaLR:
    return get_cosine_with_min_lr_schedule_with_warmup_lr_rate(
        optimizer, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=min_ratio, last_epoch=start - 1)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int, start: int = 0) -> LambdaLR:
    """cfg.optim's schedule over `total_steps` optimizer steps, positioned before step `start` (0-based).

    Sets every param group's `initial_lr` to cfg.optim.lr first: the base the schedule multiplies (a loaded
    optimizer state carries the saved run's)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.optim.lr
    return _schedule(optimizer, cfg.optim.warmup_steps, total_steps, cfg.optim.min_lr_ratio, start)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based) under make_scheduler's schedule."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return float(_schedule(probe, warmup, total, min_ratio, 0).lr_lambdas[0](step))
