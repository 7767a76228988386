"""Which micro-batches every rank trains on, and the torch DataLoaders that assemble them (used by train/loop.py).

    plan = make_plan(cfg, train_fs.lengths, world)          # grad accumulation, steps per epoch, total steps
    loader = train_loader(train_fs, plan, rank, start, device)   # micro-batches of steps start..total-1
    loader, weights = holdout_loader(hold_fs, plan, rank, device)

Data order is global, so the process count never changes what is learnt. Epoch e is
`data.tokenize.length_buckets(lengths, train.batch_size, seed + e)`: micro-batches of train.batch_size
sequences of similar length. An optimizer step consumes world x grad_accum consecutive micro-batches;
micro-batch i*world + r of the step goes to rank r at accumulation round i (`Plan.micro_batches`).

`StepSampler` is that length-bucketing order as a torch sampler: it yields the micro-batches (sample index
lists) of one rank, from a given optimizer step on. The plan is a pure function of the step, so the
sampler's position is the step a checkpoint records: a resume builds the sampler at that step and sees the
batches an uninterrupted run would (no sampler state to save). The DataLoader runs in the training process
(num_workers=0): with online features a batch runs the frozen target on the training device, which a
worker process cannot share. Its iterator draws a seed from its own generator, never from the global torch
RNG the heads' input noise uses, so adding the DataLoader changed no random stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from data.config import RunConfig
from data.featureset import FeatureSet
from data.tokenize import length_buckets
from train.errors import TrainError


@dataclass
class Plan:
    """Which micro-batches every rank trains on at every optimizer step (see the module docstring)."""

    lengths: list[int]
    batch_size: int
    world: int
    accum: int
    seed: int
    steps_per_epoch: int
    total_steps: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world * self.accum

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        return _buckets(tuple(self.lengths), self.batch_size, self.seed + epoch)

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """The accum micro-batches (sample index lists) rank `rank` trains on at optimizer step `step`."""
        per_step = self.world * self.accum
        out = []
        for i in range(self.accum):
            m = step * per_step + i * self.world + rank
            epoch, j = divmod(m, self.steps_per_epoch * per_step)
            out.append(self.epoch_batches(epoch)[j])
        return out


@lru_cache(maxsize=4)
def _buckets(lengths: tuple[int, ...], batch_size: int, seed: int) -> list[list[int]]:
    return length_buckets(list(lengths), batch_size, seed)


def make_plan(cfg: RunConfig, lengths: list[int], world: int) -> Plan:
    """Grad accumulation, steps per epoch and total steps for `world` processes."""
    bs = cfg.train.batch_size
    if bs < 1:
        raise TrainError(f"train.batch_size {bs}: must be >= 1")
    if cfg.train.global_batch_size is not None:
        g = cfg.train.global_batch_size
        if g % (bs * world):
            raise TrainError(f"train.global_batch_size {g} is not a multiple of train.batch_size {bs} x {world} processes")
        accum = g // (bs * world)
    else:
        accum = cfg.optim.grad_accum
    if accum < 1:
        raise TrainError(f"optim.grad_accum {accum}: must be >= 1")
    n_micro = len(_buckets(tuple(lengths), bs, cfg.seed))
    steps_per_epoch = n_micro // (world * accum)
    if steps_per_epoch < 1:
        raise TrainError(
            f"{len(lengths)} training conversations make {n_micro} micro-batches of {bs}, fewer than one "
            f"optimizer step needs ({world} processes x {accum} accumulation); lower train.batch_size or "
            f"train.global_batch_size, or add data"
        )
    total = cfg.train.max_steps if cfg.train.max_steps is not None else cfg.train.epochs * steps_per_epoch
    if total < 1:
        raise TrainError(f"nothing to train: train.max_steps / train.epochs give {total} steps")
    return Plan(list(lengths), bs, world, accum, cfg.seed, steps_per_epoch, total)


class StepSampler(Sampler[list[int]]):
    """Rank `rank`'s micro-batches of optimizer steps start, start+1, ..., plan.total_steps-1, in order."""

    def __init__(self, plan: Plan, rank: int, start: int = 0):
        self.plan, self.rank, self.start = plan, rank, start

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.plan.total_steps):
            yield from self.plan.micro_batches(step, self.rank)

    def __len__(self) -> int:
        return (self.plan.total_steps - self.start) * self.plan.accum


class FeatureBatches(Dataset):
    """A FeatureSet whose items are whole micro-batches: `ds[[3, 17, 5]]` is `fs.batch([3, 17, 5])` on `device`.

    Fetched a micro-batch at a time (not sample by sample) because online features run the target over
    the padded batch at once."""

    def __init__(self, fs: FeatureSet, device: torch.device):
        self.fs, self.device = fs, device

    def __len__(self) -> int:
        return len(self.fs)

    def __getitem__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in self.fs.batch(indices).items()}


def _loader(fs: FeatureSet, sampler: Sampler[list[int]] | list[list[int]], device: torch.device) -> DataLoader:
    # batch_size=None: the sampler yields whole micro-batches, FeatureBatches assembles each.
    return DataLoader(FeatureBatches(fs, device), sampler=sampler, batch_size=None, num_workers=0,
                      generator=torch.Generator())


def train_loader(fs: FeatureSet, plan: Plan, rank: int, start: int, device: torch.device) -> DataLoader:
    """Rank `rank`'s training micro-batches from optimizer step `start` to the end (plan.accum per step)."""
    return _loader(fs, StepSampler(plan, rank, start), device)


def holdout_loader(fs: FeatureSet, plan: Plan, rank: int, device: torch.device) -> tuple[DataLoader, list[float]]:
    """Rank `rank`'s share of the held-out micro-batches (length-bucketed, in a fixed order) and their weights.

    Every rank runs the same number of forwards (ZeRO-3 gathers collectively): a rank past the end repeats
    micro-batch 0 with weight 0."""
    batches = sorted(_buckets(tuple(fs.lengths), plan.batch_size, plan.seed), key=lambda b: b[0])
    per_rank = -(-len(batches) // plan.world)
    mine = [i * plan.world + rank for i in range(per_rank)]
    chosen = [batches[j] if j < len(batches) else batches[0] for j in mine]
    return _loader(fs, chosen, device), [1.0 if j < len(batches) else 0.0 for j in mine]
