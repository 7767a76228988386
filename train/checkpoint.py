"""Checkpoints of a training run and resuming from them (used by train/loop.py).

    resume = open_resume(cfg, "auto", trust=False)     # before anything heavy: which checkpoint, which changes
    start = restore(resume, accelerator, model, optimizer, plan, cfg)    # after accelerator.prepare
    write_checkpoint(OUT / "checkpoints" / "step-00000120", accelerator, model, optimizer, scheduler,
                     write_head, record)

A checkpoint is the folder OUT/checkpoints/step-NNNNNNNN. A single-process or DDP run writes the head's
weights as safetensors (`model.safetensors`) and the rest with torch.save: `state.pt` (AdamW state, grad
scaler) and `rng.rankR.pt` (each rank's Python, numpy, torch and CUDA RNG states). Those are read back with
torch.load(weights_only=True), which refuses any pickled object other than tensors and plain containers, so
nothing in the folder can execute on load, whoever wrote it. DeepSpeed and FSDP write their own (pickle)
files through accelerator.save_state; resuming those needs `--trust-checkpoint`. progress.json is written
last (atomically): the step, the lr scheduler's state_dict (its position), the config, the target's record
and every other file's sha256, so a folder without a sound progress.json is unfinished. The data order needs
no state: it is a pure function of the step (train/batches.py).

`--resume PATH|auto` reads progress.json, checks every checksum and refuses files it would not read safely
(any but .json, .safetensors and its own weights_only .pt files) unless trusted;
`auto` takes the newest sound checkpoint, skipping a corrupt newest one with a warning. A changed config
key is applied and listed in the run's `resume` event, or refused when it would change the model, its
data or the data order (FIXED_ON_RESUME). The two newest checkpoints are kept (rotate_checkpoints:
accelerate's ProjectConfiguration(total_limit=...) rotates only folders its own save_state names, and its
load_state unpickles the RNG states with weights_only=False, which this format avoids).
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from data.cli import write_atomic
from data.config import RunConfig, to_dict
from heads.base import TargetIO, check_finite, check_target, sha256_file
from train.batches import Plan
from train.errors import TrainError

# Files this module reads without running code: JSON, safetensors, and its own torch.save files (.pt), which
# it reads only with weights_only=True. Anything else (accelerate's .pkl/.bin) needs --trust-checkpoint.
SAFE_SUFFIXES = (".json", ".safetensors", ".pt")
WEIGHTS_FILE = "model.safetensors"  # the head's weights
STATE_FILE = "state.pt"  # optimizer and grad scaler state
CKPT_FORMAT = "draftheads-state-2"
KEEP_CHECKPOINTS = 2
# Config keys a resume cannot change (they define the model, its data or its data order), except the
# caches and paths in FREE_ON_RESUME; every other changed key is applied and recorded in a `resume` event.
FIXED_ON_RESUME = ("target.", "data.", "features.", "head.", "seed", "train.batch_size", "train.global_batch_size",
                   "optim.grad_accum", "optim.betas", "train.mixed_precision")
FREE_ON_RESUME = ("data.cache_dir", "features.store", "features.verify_on_read", "target.device")


# ----------------------------------------------------------------------------------------------- finding
def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict, now: dict, defaults: dict | None = None) -> dict[str, list[Any]]:
    """{dotted key: [saved value, this run's value]} for every key that differs (`out` ignored: runs move).

    A key the saved config lacks (added to the schema after that run was written) reads as its value in
    `defaults`, so a key that is new and left at its default is no change and does not block a resume."""
    a, b, d = _flat(saved), _flat(now), _flat(defaults or {})
    a = {**{k: v for k, v in d.items() if k in b}, **a}
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
    fmt = progress.get("format")  # None: a run from before this module had its own format (accelerate's)
    if fmt not in (CKPT_FORMAT, "accelerate", None):
        raise TrainError(f"{path}: checkpoint format {fmt!r} is not {CKPT_FORMAT!r} (written by another version); "
                         f"start a new --out")
    if fmt != CKPT_FORMAT and not trust:
        raise TrainError(f"{path}: not a {CKPT_FORMAT} checkpoint (an older or DeepSpeed/FSDP one, accelerate's "
                         f"pickle files); resume it with --trust-checkpoint if you wrote it yourself")
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


@dataclass
class Resume:
    """The checkpoint a run continues from (ckpt None: a fresh run) and the config keys it changes."""

    ckpt: Path | None = None
    progress: dict = field(default_factory=dict)
    changes: dict[str, list[Any]] = field(default_factory=dict)

    def check_target(self, target: TargetIO) -> None:
        """The loaded target has the weights of the run that wrote the checkpoint (HeadMismatchError if not)."""
        if "target" in self.progress:
            check_target(self.progress["target"], target, str(self.ckpt))


def open_resume(cfg: RunConfig, resume: str | None, trust: bool) -> Resume:
    """find_checkpoint, then refuse a changed key a resume cannot apply (FIXED_ON_RESUME), naming it."""
    ckpt, progress = find_checkpoint(Path(cfg.out), resume, trust)
    # the defaults of this schema, with this run's head family (each family's head keys have their own)
    defaults = to_dict(replace(RunConfig(), head=type(cfg.head)()))
    changes = config_changes(progress["config"], to_dict(cfg), defaults) if "config" in progress else {}
    fixed = [k for k in changes if k.startswith(FIXED_ON_RESUME) and k not in FREE_ON_RESUME]
    if fixed:
        raise TrainError(f"{ckpt}: a resumed run cannot change {', '.join(fixed)} (saved "
                         f"{', '.join(f'{k}={changes[k][0]!r}' for k in fixed)}); start a new --out instead")
    return Resume(ckpt, progress, changes)


# ----------------------------------------------------------------------------------------------- the state files
def _load_safe(path: Path) -> Any:
    """torch.load restricted to tensors and plain containers (weights_only): a planted pickle cannot run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch names the refused global in a long paragraph: keep the name
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise TrainError(f"{path}: refused: it pickles an object other than tensors and plain values "
                         f"({found.group(1) if found else 'weights_only'}); it was not loaded") from None


def _rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) RNG states in types weights_only loads (numpy's key array as a tensor)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"][:torch.cuda.device_count()]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def save_state(path: Path, accelerator: Any, model: nn.Module, optimizer: Any, main_proc: bool) -> None:
    """The checkpoint of a single-process or DDP run (the module holds the whole head): head weights as
    safetensors, optimizer and grad scaler as STATE_FILE and each rank's RNG states, read back weights_only."""
    path.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), path / f"rng.rank{accelerator.process_index}.pt")
    if not main_proc:
        return
    weights = {k: v.detach().cpu().contiguous().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    check_finite(weights, str(path))
    save_file(weights, str(path / WEIGHTS_FILE))
    torch.save({"optimizer": optimizer.state_dict(),
                "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None},
               path / STATE_FILE)


def load_state(path: Path, accelerator: Any, model: nn.Module, optimizer: Any) -> None:
    """Load what save_state wrote (safetensors, and torch.load with weights_only)."""
    weights = load_file(str(path / WEIGHTS_FILE))
    check_finite(weights, str(path))
    accelerator.unwrap_model(model).load_state_dict(weights)
    state = _load_safe(path / STATE_FILE)
    optimizer.load_state_dict(state["optimizer"])
    if state["scaler"] is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    rank_file = path / f"rng.rank{accelerator.process_index}.pt"
    if rank_file.is_file():  # a resume on fewer ranks: the others start from the seed's state
        _set_rng_state(_load_safe(rank_file))


def own_format(accelerator: Any) -> bool:
    """Whether this run writes this module's format (DeepSpeed and FSDP shard the state their own way)."""
    return accelerator.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP)


# ----------------------------------------------------------------------------------------------- writing
def rotate_checkpoints(folder: Path, keep: int = KEEP_CHECKPOINTS) -> None:
    """Delete all but the `keep` newest step-* checkpoints in `folder` (names sort by step)."""
    for old in sorted(folder.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(path: Path, accelerator: Any, model: nn.Module, optimizer: Any, scheduler: LRScheduler,
                     write_head: Callable[[], None], record: dict[str, Any]) -> Path:
    """Write the checkpoint folder `path` on every rank (a collective), then rotate; returns `path`.

    `write_head()` writes OUT/head alongside (all ranks call it: gathering a sharded head is collective);
    `record` (step, global batch, config, target, ...) goes into progress.json with the scheduler's state
    and the files' sha256."""
    main_proc = accelerator.is_main_process
    if main_proc and (path / "progress.json").exists():
        (path / "progress.json").unlink()  # a rewrite: the folder is unfinished until progress.json
    accelerator.wait_for_everyone()
    if own_format(accelerator):
        save_state(path, accelerator, model, optimizer, main_proc)
    else:
        accelerator.save_state(str(path))
    write_head()
    accelerator.wait_for_everyone()
    if main_proc:
        files = {str(f.relative_to(path)): sha256_file(f) for f in sorted(path.rglob("*"))
                 if f.is_file() and f.name != "progress.json"}
        write_atomic(path / "progress.json", json.dumps(
            {"format": CKPT_FORMAT if own_format(accelerator) else "accelerate", **record,
             "scheduler": scheduler.state_dict(), "files": files}))
        rotate_checkpoints(path.parent)
    accelerator.wait_for_everyone()
    return path


# ----------------------------------------------------------------------------------------------- resuming
def _scheduler_step(ckpt: Path, progress: dict) -> int:
    """The scheduler position progress.json records, which must be its step; checkpoints written before
    the scheduler was saved have none: the step is the position."""
    step = int(progress["step"])
    saved = progress.get("scheduler", {"last_epoch": step})
    last = saved.get("last_epoch") if isinstance(saved, dict) else None
    if last != step:
        raise TrainError(f"{ckpt / 'progress.json'}: the scheduler's position {last!r} is not the step {step}")
    return step


def restore(resume: Resume, accelerator: Any, model: nn.Module, optimizer: Any, plan: Plan, cfg: RunConfig) -> int:
    """Load resume.ckpt into the prepared model and optimizer; returns the step to continue from (0: fresh).

    The optimizer keeps the saved moments; this config's weight decay applies (and its lr: make_scheduler)."""
    if resume.ckpt is None:
        return 0
    ckpt, progress = resume.ckpt, resume.progress
    if progress.get("global_batch") != plan.global_batch:
        raise TrainError(f"{ckpt}: saved with a global batch of {progress.get('global_batch')} sequences, "
                         f"this run has {plan.global_batch}; set train.global_batch_size to resume it")
    start = _scheduler_step(ckpt, progress)
    if progress.get("format") == CKPT_FORMAT:
        if not own_format(accelerator):
            raise TrainError(f"{ckpt}: written by a single-process/DDP run; DeepSpeed/FSDP cannot resume it")
        load_state(ckpt, accelerator, model, optimizer)
    else:
        accelerator.load_state(str(ckpt))  # --trust-checkpoint: accelerate's own (pickle) files
    accelerator.step = start * plan.accum
    for group in optimizer.param_groups:
        group["weight_decay"] = cfg.optim.weight_decay
    return start
