"""The one training loop for every head family (EAGLE-1/3, Medusa, MTP), run by accelerate.

    python train/eagle.py --config configs/tiny-eagle.yaml --out runs/tiny
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train/eagle.py --config C --out D
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml train/eagle.py --config C --out D
    python train/eagle.py --config C --out D --resume auto        # continue from D's latest checkpoint

Entry scripts call `main(argv, family=...)`; the loop knows a family only through heads.base.family_module:
`feature_layers`, `build`, `loss`, and, when the module has it, `prepare(head_cfg, train_dataset, target)
-> {name: tensor}` (initial values for data-derived head tensors, e.g. EAGLE-3's d2t/t2d), loaded into the
freshly built head.

What a run does:
- Accelerator (DDP / DeepSpeed ZeRO-2/3 / FSDP from the accelerate config file; gloo on CPU; bf16 or fp32
  from train.mixed_precision); `accelerate.utils.set_seed(seed)` once before anything random.
- A launch that accelerate would silently run other than asked (DeepSpeed/FSDP config, CPU DDP or N
  unsynchronised copies started) is refused by check_launch.
- Target (train/placement.py): features.mode=online keeps the frozen target's decoder to compute the
  features: replicated under one process, DDP and ZeRO-2, sharded under ZeRO-3 (partitioned, in its own
  optimizer-free engine) and FSDP (fully_shard per layer). Offline (a store from `python -m data.extract`)
  keeps only the pieces the heads call (TargetIO: embedding, lm_head, final norm, last decoder layer,
  rotary module), which are whole on every process in every mode.
- Data order is global, so the process count never changes what is learnt. Epoch e is
  `length_buckets(lengths, train.batch_size, seed + e)`: micro-batches of train.batch_size sequences. An
  optimizer step consumes world x grad_accum consecutive micro-batches; micro-batch i*world + r of the step
  goes to rank r at accumulation round i. The loss of each micro-batch is normalised within the micro-batch,
  gradients are averaged over ranks (DDP) and rounds (accumulation): the same mean over the same
  micro-batches whatever the split. Global batch = train.batch_size x processes x grad_accum sequences;
  grad_accum is optim.grad_accum, or train.global_batch_size / (batch_size x processes) when that is set,
  so `python train/eagle.py` and a 2-process launch of the same config agree (up to float summation
  order). Steps per epoch = floor(micro-batches per epoch / (world x grad_accum)).
- AdamW over the head's parameters only; linear warmup (optim.warmup_steps) then cosine to
  lr x min_lr_ratio at the last step; gradient clipping (optim.grad_clip); the scheduler steps once per
  optimizer step (never scaled by the process count).
- Every train.checkpoint_every steps: OUT/head (save_head, loadable alone) and
  OUT/checkpoints/step-NNNNNNNN (accelerator.save_state: head, optimizer, scheduler, RNG states) plus
  progress.json; the two newest checkpoints are kept. `--resume PATH|auto` reloads one and continues with
  the same data order, so a stopped-and-resumed run logs the losses of an uninterrupted one.
- SIGTERM or SIGUSR1 (SLURM preemption / time limit): the step in flight finishes, all ranks agree, a
  checkpoint is written, the line `stopped by signal; state saved to DIR` is printed, and the process
  exits with code 0.
- Held-out evaluation every train.eval_every steps, before the first step and at the end: mean loss,
  per-step top-1 `top1/k` (summed over positions: a family's `n/k` metric weights its batch) and the
  simulated acceptance length
      tau_sim = 1 + sum_{k=0}^{K-1} prod_{j=0}^{k} top1_j
  i.e. tokens per target pass (counting the bonus/correction token) of a greedy chain of K drafts if step
  j were accepted independently with probability top1_j; K = the steps the family reports (EAGLE-3: its
  ttt_length; EAGLE-1: 1; Medusa: its heads). Logged to metrics.jsonl and printed.
- Logging on rank 0 only: tqdm (loss, tokens/s), OUT/metrics.jsonl (one JSON object per line: a `start`
  event with world_size, distributed_type, grad_accum, global_batch_size and the target's placement;
  `train` rows every train.log_every steps with loss averaged over all ranks; `eval` rows; an `end`
  event), wandb in logging.wandb_mode (offline by default; `online` without stored credentials falls back
  to offline instead of prompting; `disabled`).
  The resolved config is written to OUT/config.yaml.
- At the end every rank writes OUT/final_params_digest.rank{R}.txt: the SHA-256 of the head parameters
  it holds (identical on all ranks under DDP or ZeRO-2) — the distributed test compares them; the
  `end` event carries rank 0's digest and the world size. The process group is destroyed at exit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from data.cli import UserError, cli_main, write_atomic
from data.config import RunConfig, check_layer_ids, parse_args, save_config, to_dict
from heads.base import (
    HeadMismatchError,
    TargetIO,
    check_finite,
    check_target,
    family_module,
    save_head,
    sha256_file,
)
from train.placement import load_frozen_target

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
KEEP_CHECKPOINTS = 2


class TrainError(UserError, ValueError):
    """The run cannot start as configured; the message names the setting."""


# ----------------------------------------------------------------------------------------------- plan
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
    from data.tokenize import length_buckets

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


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): linear warmup, then cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------- metrics
def step_keys(metrics: dict[str, float]) -> list[int]:
    return sorted(int(k.split("/")[1]) for k in metrics if k.startswith("top1/") and k.split("/")[1].isdigit())


def simulated_tau(top1: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} top1_j: tokens per target pass of a greedy chain (see the module docstring)."""
    tau, run = 1.0, 1.0
    for a in top1:
        run *= a
        tau += run
    return tau


class MetricSum:
    """Sums of batch metrics: losses per batch, `top1/k` weighted by `n/k` (1 when a family gives none)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, loss: float, metrics: dict[str, float], weight: float = 1.0) -> None:
        self.sums["loss"] += weight * loss
        self.sums["batches"] += weight
        for k, v in metrics.items():
            if k.startswith("n/") or k.startswith("top1/"):
                continue
            self.sums[k] += weight * float(v)
        for s in step_keys(metrics):
            n = float(metrics.get(f"n/{s}", 1.0)) * weight
            self.sums[f"top1/{s}"] += float(metrics[f"top1/{s}"]) * n
            self.sums[f"n/{s}"] += n

    def reduce(self, accelerator: Any) -> dict[str, float]:
        """Sum over ranks (every rank holds the same keys), then turn sums into means."""
        keys = sorted(self.sums)
        vals = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            vals = accelerator.reduce(vals, reduction="sum")
        tot = dict(zip(keys, vals.tolist()))
        batches = max(tot.pop("batches", 0.0), 1e-12)
        out = {k: v / batches for k, v in tot.items() if not k.startswith(("n/", "top1/"))}
        top1 = []
        for s in sorted(int(k.split("/")[1]) for k in tot if k.startswith("top1/")):
            out[f"top1/{s}"] = tot[f"top1/{s}"] / max(tot[f"n/{s}"], 1e-12)
            top1.append(out[f"top1/{s}"])
        if top1:
            out["tau_sim"] = simulated_tau(top1)
        return out


class MetricsLog:
    """OUT/metrics.jsonl and wandb on rank 0; nothing on other ranks."""

    def __init__(self, cfg: RunConfig, out: Path, enabled: bool):
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.wandb = None
        if not enabled or cfg.logging.wandb_mode == "disabled":
            return
        mode = cfg.logging.wandb_mode
        if mode not in ("offline", "online"):
            raise TrainError(f"logging.wandb_mode '{mode}' is not one of offline, online, disabled")
        netrc = Path("~/.netrc").expanduser()
        if mode == "online" and not os.environ.get("WANDB_API_KEY") and not (
            netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
        ):
            print("wandb: no stored credentials, logging offline instead (wandb sync later)", file=sys.stderr)
            mode = "offline"
        import wandb

        run_id = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
        self.wandb = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.run_name or out.name,
                                id=run_id, resume="allow", mode=mode, dir=str(out), config=to_dict(cfg))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(_finite_or_none(row), allow_nan=False) + "\n")
        if self.wandb is not None and "step" in row:
            self.wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=int(row["step"]))

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def format_eval(step: int, m: dict[str, float]) -> str:
    steps = [m[f"top1/{s}"] for s in sorted(int(k.split("/")[1]) for k in m if k.startswith("top1/"))]
    top1 = " ".join(f"{a:.3f}" for a in steps)
    return (f"eval step {step}: held-out loss {m['loss']:.4f} | top-1 per draft step {top1} | "
            f"simulated tau {m.get('tau_sim', float('nan')):.3f} (tokens per target pass incl. bonus, "
            f"greedy chain of {len(steps)})")


# ----------------------------------------------------------------------------------------------- pieces
class LossModule(nn.Module):
    """The head plus its family's loss as one module, so DDP/DeepSpeed/FSDP wrap a forward that returns
    (loss, metrics). The frozen target is held as a plain attribute: never trained, never saved."""

    def __init__(self, head: nn.Module, loss_fn: Callable, target: TargetIO):
        super().__init__()
        self.head = head
        self.loss_fn = loss_fn
        self.target = target

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss_fn(self.head, batch, self.target)


# ----------------------------------------------------------------------------------------------- checkpoints
# A checkpoint of a single-process or DDP run holds only JSON and safetensors (`state.*`, `rng.rankR.*`,
# progress.json with every file's sha256): nothing in it can execute on load. DeepSpeed and FSDP write
# their own (pickle) files through accelerator.save_state; resuming those needs --trust-checkpoint.
SAFE_SUFFIXES = (".json", ".safetensors")
CKPT_FORMAT = "draftheads-state"
# Config keys a resume cannot change (they define the model, its data or its data order), except the
# caches and paths in FREE_ON_RESUME; every other changed key is applied and recorded in a `resume` event.
FIXED_ON_RESUME = ("target.", "data.", "features.", "head.", "seed", "train.batch_size", "train.global_batch_size",
                   "optim.grad_accum", "optim.betas", "train.mixed_precision")
FREE_ON_RESUME = ("data.cache_dir", "features.store", "features.verify_on_read", "target.device")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict, now: dict) -> dict[str, list[Any]]:
    """{dotted key: [saved value, this run's value]} for every key that differs (`out` ignored: runs move)."""
    a, b = _flat(saved), _flat(now)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if k != "out" and a.get(k) != b.get(k)}


def _pickle_files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.suffix not in SAFE_SUFFIXES)


def read_checkpoint(ckpt: Path, trust: bool = False) -> dict:
    """progress.json of a checkpoint, after checking it is whole (checksums) and holds nothing executable.

    TrainError names the file: unreadable or half-written progress.json, a missing or changed file, or a
    pickle file (unless `trust`: --trust-checkpoint)."""
    path = ckpt / "progress.json"
    try:
        progress = json.loads(path.read_text())
        if not isinstance(progress, dict) or not isinstance(progress.get("step"), int):
            raise ValueError("no integer 'step'")
    except OSError as e:
        raise TrainError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TrainError(f"{path}: corrupt checkpoint progress file ({e})") from None
    for name, sha in progress.get("files", {}).items():
        f = ckpt / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise TrainError(f"{path}: file '{name}' lies outside the checkpoint folder")
        if not f.is_file():
            raise TrainError(f"{f}: missing (listed in {path})")
        if sha256_file(f) != sha:
            raise TrainError(f"{f}: corrupted or changed (sha256 differs from {path})")
    bad = _pickle_files(ckpt)
    if bad and not trust:
        raise TrainError(f"{ckpt}: holds pickle files that could run code when loaded ({', '.join(bad[:3])}); "
                         f"resume only a checkpoint you wrote yourself, with --trust-checkpoint")
    if progress.get("format") != CKPT_FORMAT and not trust:
        raise TrainError(f"{path}: not a {CKPT_FORMAT} checkpoint (an older or DeepSpeed/FSDP one); resume it "
                         f"with --trust-checkpoint if you wrote it yourself")
    return progress


def find_checkpoint(out: Path, resume: str | None, trust: bool) -> tuple[Path | None, dict]:
    """The checkpoint to resume and its progress: `resume` PATH, or "auto" = the newest sound one in
    OUT/checkpoints (a corrupt newest one is skipped with a warning; the previous one is used)."""
    if resume is None:
        return None, {}
    if resume != "auto":
        ckpt = Path(resume)
        if not ckpt.is_dir():
            raise TrainError(f"--resume {resume}: no such checkpoint folder")
        return ckpt, read_checkpoint(ckpt, trust)
    for ckpt in sorted((out / "checkpoints").glob("step-*"), reverse=True):
        try:
            return ckpt, read_checkpoint(ckpt, trust)
        except TrainError as e:
            if "pickle" in str(e) or "--trust-checkpoint" in str(e):
                raise
            print(f"warning: skipping checkpoint {ckpt}: {e}", file=sys.stderr, flush=True)
    return None, {}


def _finite_or_none(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf are not JSON: they are written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """Python, numpy, torch (and CUDA) RNG states as JSON + tensors (no pickle)."""
    import random

    import numpy as np

    py = random.getstate()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    return {"python": [py[0], list(py[1]), py[2]], "numpy": [name, int(pos), int(has_gauss), float(gauss)]}, tensors


def _set_rng_state(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    import random

    import numpy as np

    v, state, gauss = meta["python"]
    random.setstate((v, tuple(state), gauss))
    name, pos, has_gauss, g = meta["numpy"]
    np.random.set_state((name, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, g))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(torch.cuda.device_count()) if f"cuda.{i}" in tensors]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def save_state(path: Path, accelerator: Any, model: nn.Module, optimizer: Any, main_proc: bool) -> None:
    """The pickle-free checkpoint of a single-process or DDP run (the module holds the whole head)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    meta, rng = _rng_state()
    save_file({k: v.contiguous() for k, v in rng.items()}, str(path / f"rng.rank{accelerator.process_index}.safetensors"))
    write_atomic(path / f"rng.rank{accelerator.process_index}.json", json.dumps(meta))
    if not main_proc:
        return
    tensors = {f"model.{k}": v.detach().cpu().contiguous().clone()
               for k, v in accelerator.unwrap_model(model).state_dict().items()}
    check_finite({k.removeprefix("model."): v for k, v in tensors.items()}, str(path))
    opt = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in opt["state"].items():
        scalars[str(pid)] = {}
        for name, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{pid}.{name}"] = v.detach().cpu().contiguous().clone()
            else:
                scalars[str(pid)][name] = v
    state = {"param_groups": opt["param_groups"], "optim_scalars": scalars,
             "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None}
    save_file(tensors, str(path / "state.safetensors"))
    write_atomic(path / "state.json", json.dumps(state))


def load_state(path: Path, accelerator: Any, model: nn.Module, optimizer: Any) -> None:
    """Load what save_state wrote (safetensors and JSON only)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "state.safetensors"))
    meta = json.loads((path / "state.json").read_text())
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    check_finite(weights, str(path))
    accelerator.unwrap_model(model).load_state_dict(weights)
    opt_state: dict[int, dict[str, Any]] = {int(pid): dict(s) for pid, s in meta["optim_scalars"].items()}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, pid, name = k.split(".", 2)
            opt_state.setdefault(int(pid), {})[name] = v
    optimizer.load_state_dict({"state": opt_state, "param_groups": meta["param_groups"]})
    if meta.get("scaler") is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(meta["scaler"])
    rank_file = path / f"rng.rank{accelerator.process_index}.safetensors"
    if rank_file.is_file():  # a resume on fewer ranks: the others start from the seed's state
        _set_rng_state(json.loads(rank_file.with_suffix(".json").read_text()), load_file(str(rank_file)))


def params_digest(module: nn.Module) -> str:
    """SHA-256 of the parameters this process holds (its shard under ZeRO-3 / FSDP)."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard
        h.update(name.encode())
        h.update(t.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def check_launch(dist: Any, env: dict[str, str] | None = None) -> None:
    """Refuse a launch that accelerate would run other than asked, with no error of its own.

    `accelerate launch` tells the processes what the config file asked for (ACCELERATE_USE_DEEPSPEED /
    ACCELERATE_USE_FSDP); accelerate then silently picks something else on a CPU machine: plain CPU DDP
    for DeepSpeed when ACCELERATE_USE_CPU=1 is set, CPU DDP or N unsynchronised copies for FSDP, and N
    unsynchronised copies for ddp.yaml without ACCELERATE_USE_CPU=1.
    """
    from accelerate.utils import DistributedType

    env = os.environ if env is None else env
    n = env.get("WORLD_SIZE", "1")
    multi = int(n) > 1
    if env.get("ACCELERATE_USE_DEEPSPEED") == "true" and dist != DistributedType.DEEPSPEED:
        raise TrainError(f"the accelerate config asks for DeepSpeed, but accelerate runs {dist.value}: unset "
                         f"ACCELERATE_USE_CPU (DeepSpeed runs on CPU without it)")
    if env.get("ACCELERATE_USE_FSDP") == "true" and dist != DistributedType.FSDP:
        raise TrainError(f"the accelerate config asks for FSDP, but accelerate runs {dist.value}: accelerate "
                         f"enables FSDP on GPUs only; without GPUs use ddp.yaml (with ACCELERATE_USE_CPU=1) or a "
                         f"DeepSpeed config")
    if multi and dist == DistributedType.NO:
        # accelerate started the processes but syncs nothing between them: each would train its own copy.
        raise TrainError(f"{n} processes were started, but accelerate runs them unsynchronised (distributed type "
                         f"NO). Without GPUs: ddp.yaml needs ACCELERATE_USE_CPU=1 in the environment, the DeepSpeed "
                         f"configs work as they are, and fsdp.yaml cannot run (accelerate enables FSDP on GPUs only)")


# ----------------------------------------------------------------------------------------------- train
def train(cfg: RunConfig, resume: str | None = None, on_step: Callable[[int], None] | None = None,
          trust_checkpoint: bool = False) -> dict[str, Any]:
    """Train cfg.head on cfg.data; returns a summary (final held-out metrics, steps, out folder).

    `resume`: a checkpoint folder, or "auto" (the newest sound one in OUT/checkpoints, if any). A changed
    config key is applied and logged (a `resume` event) or refused (FIXED_ON_RESUME). `trust_checkpoint`
    allows checkpoints holding pickle files (DeepSpeed/FSDP, older runs). `on_step(step)` is called on
    every rank after each optimizer step (used by tests to deliver a signal at a known step).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs, set_seed

    from data.featureset import open_featureset
    from data.target import load_config_only, text_config
    from data.tokenize import build_datasets

    mod = family_module(cfg.head.family)
    out = Path(cfg.out)
    # Before anything heavy: the checkpoint is sound and the config changes are ones a resume can apply.
    ckpt, progress = find_checkpoint(out, resume, trust_checkpoint)
    changes = config_changes(progress["config"], to_dict(cfg)) if "config" in progress else {}
    fixed = [k for k in changes if k.startswith(FIXED_ON_RESUME) and k not in FREE_ON_RESUME]
    if fixed:
        raise TrainError(f"{ckpt}: a resumed run cannot change {', '.join(fixed)} (saved "
                         f"{', '.join(f'{k}={changes[k][0]!r}' for k in fixed)}); start a new --out instead")
    check_layer_ids(cfg, text_config(load_config_only(cfg.target)))  # before the weights load
    # CPU process groups need gloo (DeepSpeed would otherwise ask for a GPU backend); a single process
    # must get no backend at all, or accelerate expects a process group that nobody started.
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if multi and not torch.cuda.is_available() else []
    accelerator = Accelerator(mixed_precision=cfg.train.mixed_precision, kwargs_handlers=kwargs)
    check_launch(accelerator.distributed_type)
    world, rank = accelerator.num_processes, accelerator.process_index
    main_proc = accelerator.is_main_process
    stop = {"signal": None}
    previous = {s: signal.signal(s, lambda signum, frame: stop.update(signal=signum)) for s in STOP_SIGNALS}
    own_state = accelerator.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    try:
        set_seed(cfg.seed)
        if main_proc:
            out.mkdir(parents=True, exist_ok=True)
        online = cfg.features.mode == "online"
        ds_plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        frozen = load_frozen_target(cfg, accelerator, online)
        model, tok, target = frozen.model, frozen.tokenizer, frozen.io
        if "target" in progress:  # the same weights as the run that wrote the checkpoint
            check_target(progress["target"], target, str(ckpt))
        if main_proc:
            save_config(cfg, out)  # after the resume checks: config.yaml says what runs
        with accelerator.main_process_first():
            train_ds, hold_ds = build_datasets(cfg, tok)
        layer_ids = list(mod.feature_layers(cfg.head, target.config))
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        train_fs = open_featureset(cfg, train_ds, model, layer_ids, "train", pad_id, target=target)
        hold_fs = open_featureset(cfg, hold_ds, model, layer_ids, "holdout", pad_id,
                                  target=target) if len(hold_ds) else None
        plan = make_plan(cfg, train_fs.lengths, world)
        try:
            init = mod.prepare(cfg.head, train_ds, target) if hasattr(mod, "prepare") else {}
            head = mod.build(cfg.head, target)
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
        wrapped = LossModule(head, mod.loss, target)
        optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                      weight_decay=cfg.optim.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, cfg.optim.warmup_steps, plan.total_steps, cfg.optim.min_lr_ratio))
        accelerator.gradient_accumulation_steps = plan.accum
        if ds_plugin is not None:
            ds_cfg = ds_plugin.deepspeed_config
            ds_cfg["train_micro_batch_size_per_gpu"] = plan.batch_size
            ds_cfg["gradient_accumulation_steps"] = plan.accum
            ds_cfg["train_batch_size"] = plan.global_batch
            if ds_cfg.get("gradient_clipping") == "auto":
                ds_cfg["gradient_clipping"] = cfg.optim.grad_clip
        wrapped, optimizer = accelerator.prepare(wrapped, optimizer)
        # The scheduler is not checkpointed: its state is the step, and the lr schedule of THIS config
        # applies after a resume (set below).

        start = 0
        if ckpt is not None:
            if progress.get("global_batch") != plan.global_batch:
                raise TrainError(f"{ckpt}: saved with a global batch of {progress.get('global_batch')} sequences, "
                                 f"this run has {plan.global_batch}; set train.global_batch_size to resume it")
            if progress.get("format") == CKPT_FORMAT:
                if not own_state:
                    raise TrainError(f"{ckpt}: written by a single-process/DDP run; DeepSpeed/FSDP cannot resume it")
                load_state(ckpt, accelerator, wrapped, optimizer)
            else:
                accelerator.load_state(str(ckpt))  # --trust-checkpoint: accelerate's own (pickle) files
            start = int(progress["step"])
            accelerator.step = start * plan.accum
            scheduler.last_epoch = start
            for g, base in zip(optimizer.param_groups, scheduler.base_lrs):
                g["initial_lr"] = base
                g["lr"] = base * lr_factor(start, cfg.optim.warmup_steps, plan.total_steps, cfg.optim.min_lr_ratio)
                g["weight_decay"] = cfg.optim.weight_decay
            scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
            if main_proc:
                print(f"resumed from {ckpt} at step {start}")
        log = MetricsLog(cfg, out, main_proc)
        if ckpt is not None and start >= plan.total_steps:
            if main_proc:
                print(f"{ckpt}: this run already finished ({start} of {plan.total_steps} steps); nothing to do "
                      f"(raise train.max_steps or train.epochs to train further)", flush=True)
            log.close()
            return {"out": str(out), "step": start, "stopped": False, "already_finished": True}
        log.write({"event": "start", "family": cfg.head.family, "world_size": world,
                   "distributed_type": str(accelerator.distributed_type.value), "grad_accum": plan.accum,
                   "per_process_batch": plan.batch_size, "global_batch_size": plan.global_batch,
                   "steps_per_epoch": plan.steps_per_epoch, "total_steps": plan.total_steps,
                   "train_conversations": len(train_ds), "holdout_conversations": len(hold_ds),
                   "features": cfg.features.mode, **frozen.stats(),
                   "resumed_from": str(ckpt) if ckpt else None, "start_step": start})
        if ckpt is not None:
            log.write({"event": "resume", "step": start, "checkpoint": str(ckpt), "changed": changes})

        def evaluate(step: int) -> dict[str, float]:
            if hold_fs is None:
                return {}
            batches = _buckets(tuple(hold_fs.lengths), plan.batch_size, cfg.seed)
            batches = sorted(batches, key=lambda b: b[0])
            per_rank = math.ceil(len(batches) / world)
            sums = MetricSum()
            wrapped.eval()
            with torch.no_grad():
                for i in range(per_rank):
                    j = i * world + rank
                    # Every rank runs the same number of forwards (ZeRO-3 gathers collectively); a
                    # rank past the end repeats batch 0 with weight 0.
                    idx, w = (batches[j], 1.0) if j < len(batches) else (batches[0], 0.0)
                    loss, m = wrapped(_to_device(hold_fs.batch(idx), accelerator.device))
                    sums.add(float(loss), m, w)
            wrapped.train()
            res = sums.reduce(accelerator)
            if main_proc:
                print(format_eval(step, res), flush=True)
            log.write({"event": "eval", "step": step, **{f"eval/{k}": v for k, v in res.items()}})
            return res

        def checkpoint(step: int) -> Path:
            path = out / "checkpoints" / f"step-{step:08d}"
            if main_proc and (path / "progress.json").exists():
                (path / "progress.json").unlink()  # a rewrite: the folder is unfinished until progress.json
            accelerator.wait_for_everyone()
            if own_state:
                save_state(path, accelerator, wrapped, optimizer, main_proc)
            else:
                accelerator.save_state(str(path))
            write_head(step)
            accelerator.wait_for_everyone()
            if main_proc:
                files = {str(f.relative_to(path)): sha256_file(f) for f in sorted(path.rglob("*"))
                         if f.is_file() and f.name != "progress.json"}
                write_atomic(path / "progress.json", json.dumps(
                    {"format": CKPT_FORMAT if own_state else "accelerate", "step": step,
                     "global_batch": plan.global_batch, "world_size": world, "config": to_dict(cfg),
                     "target": target.record(), "files": files}))
                for old in sorted((out / "checkpoints").glob("step-*"))[:-KEEP_CHECKPOINTS]:
                    shutil.rmtree(old, ignore_errors=True)
            accelerator.wait_for_everyone()
            return path

        def write_head(step: int) -> None:
            state = accelerator.get_state_dict(wrapped)
            if main_proc:
                fresh = mod.build(cfg.head, target)
                weights = {k.removeprefix("head."): v for k, v in state.items()}
                check_finite(weights, f"step {step}")
                fresh.load_state_dict(weights)
                save_head(out / "head", fresh, cfg.head, target,
                          extra={"step": step, "data": cfg.data.path, "features": cfg.features.mode,
                                 "global_batch_size": plan.global_batch})

        last_eval: dict[str, float] = {}
        if start == 0:
            last_eval = evaluate(0)
        wrapped.train()
        from tqdm import tqdm

        bar = tqdm(total=plan.total_steps, initial=start, disable=not main_proc, desc=f"train {cfg.head.family}",
                   unit="step", dynamic_ncols=True)
        window = MetricSum()
        tokens, t_last = 0, time.perf_counter()
        step, stopped = start, None
        loss_value = float("nan")
        try:  # an error mid-run must not print its one line onto the progress bar
            while step < plan.total_steps:
                for idx in plan.micro_batches(step, rank):
                    batch = _to_device(train_fs.batch(idx), accelerator.device)
                    tokens += int(batch["attention_mask"].sum())
                    with accelerator.accumulate(wrapped):
                        loss, m = wrapped(batch)
                        accelerator.backward(loss)
                        if accelerator.sync_gradients and cfg.optim.grad_clip > 0 and \
                                accelerator.distributed_type != DistributedType.DEEPSPEED:
                            accelerator.clip_grad_norm_(wrapped.parameters(), cfg.optim.grad_clip)
                        optimizer.step()
                        optimizer.zero_grad()
                    window.add(float(loss.detach()), m)
                scheduler.step()
                step += 1
                if on_step is not None:
                    on_step(step)
                if step % cfg.train.log_every == 0 or step == plan.total_steps:
                    res = window.reduce(accelerator)
                    elapsed = time.perf_counter() - t_last
                    tok_total = tokens * world
                    tps = tok_total / max(elapsed, 1e-9)
                    loss_value = res["loss"]
                    log.write({"event": "train", "step": step, "lr": scheduler.get_last_lr()[0],
                               "tokens_per_s": tps, **res})
                    bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tps:.0f}")
                    window, tokens, t_last = MetricSum(), 0, time.perf_counter()
                bar.update(1)
                if step % cfg.train.eval_every == 0 and step < plan.total_steps:
                    last_eval = evaluate(step)
                flag = torch.tensor([0 if stop["signal"] is None else 1], device=accelerator.device)
                if world > 1:
                    flag = accelerator.reduce(flag, reduction="sum")
                if int(flag) > 0 and step < plan.total_steps:
                    stopped = checkpoint(step)
                    break
                if step % cfg.train.checkpoint_every == 0 and step < plan.total_steps:
                    checkpoint(step)
        finally:
            bar.close()
        if stopped is not None:
            if main_proc:
                print(f"stopped by signal; state saved to {stopped}", flush=True)
            log.write({"event": "stopped", "step": step, "checkpoint": str(stopped)})
            log.close()
            return {"out": str(out), "step": step, "stopped": True, "checkpoint": str(stopped)}
        checkpoint(step)
        last_eval = evaluate(step) or last_eval
        digest = params_digest(accelerator.unwrap_model(wrapped))
        (out / f"final_params_digest.rank{rank}.txt").write_text(digest + "\n")
        log.write({"event": "end", "step": step, "world_size": world, "params_digest": digest,
                   "final_train_loss": loss_value, **{f"eval/{k}": v for k, v in last_eval.items()}})
        log.close()
        if main_proc:
            print(f"head saved to {out / 'head'}; metrics in {out / 'metrics.jsonl'}", flush=True)
        return {"out": str(out), "step": step, "stopped": False, "eval": last_eval, "train_loss": loss_value,
                "digest": digest, "world_size": world}
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        accelerator.wait_for_everyone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
            # accelerate told transformers "DeepSpeed"; a later model load in this process (eval_at_end)
            # must build an ordinary model.
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()


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
        from eval.run import evaluate

        result["report"] = evaluate(Path(result["out"]) / "head", cfg.eval, Path(result["out"]) / "eval",
                                    cfg.target, seed=cfg.seed)
    return result
