"""The accelerate side of a training run: the Accelerator, the launch check, the plan's batch settings, teardown.

    accelerator = make_accelerator(cfg)          # refuses a launch accelerate would run other than asked
    apply_plan(accelerator, plan, cfg)           # before accelerator.prepare
    teardown(accelerator)                        # at the end of the run, also after an error
    with claim_run_folder(cfg.out, resume):      # before anything else: the folder is this run's, locked

DDP / DeepSpeed ZeRO-2/3 / FSDP come from the accelerate config file; gloo on CPU; bf16 or fp32 from
train.mixed_precision.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from transformers.integrations import unset_hf_deepspeed_config

from data.config import RunConfig
from data.files import FolderLock, read_marker, refuse_symlinks
from train.batches import Plan
from train.errors import TrainError

# What a training writes into its folder: a fresh run (no --resume) refuses a folder that already holds one.
RUN_OUTPUTS = ("head", "checkpoints", "metrics.jsonl")


def claim_run_folder(out: str | Path, resume: str | None,
                     env: dict[str, str] | None = None) -> AbstractContextManager:
    """Refuse a run folder training must not write into, then lock it (rank 0; a context manager).

    Refused: a symlink at or inside it (writes would go through it; wandb's `latest-run` link inside wandb/
    excepted), another stage's folder (its marker),
    and, without --resume, a folder that already holds a training run (it would be silently replaced and
    metrics.jsonl would mix both runs). The data stages' files beside it (the quickstart's one folder) stay."""
    out = Path(out)
    refuse_symlinks(out, "run folder", tools=("wandb",))  # wandb links its latest run inside wandb/
    owner = read_marker(out)
    if owner not in (None, "train"):
        raise TrainError(f"{out}: this folder belongs to a {owner} run; choose another --out for training")
    if resume is None:
        done = [name for name in RUN_OUTPUTS if (out / name).exists()]
        if done:
            raise TrainError(f"{out}: already holds a training run ({done[0]}); pass --resume auto to continue it, "
                             f"or choose another --out")
    env = os.environ if env is None else env
    if env.get("RANK", "0") != "0":
        return nullcontext()  # one lock per run, held by rank 0
    return FolderLock(out, "a training")


def check_launch(dist: Any, env: dict[str, str] | None = None) -> None:
    """Refuse a launch that accelerate would run other than asked, with no error of its own.

    `accelerate launch` tells the processes what the config file asked for (ACCELERATE_USE_DEEPSPEED /
    ACCELERATE_USE_FSDP); accelerate then silently picks something else on a CPU machine: plain CPU DDP
    for DeepSpeed when ACCELERATE_USE_CPU=1 is set, CPU DDP or N unsynchronised copies for FSDP, and N
    unsynchronised copies for ddp.yaml without ACCELERATE_USE_CPU=1.
    """
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


def make_accelerator(cfg: RunConfig) -> Accelerator:
    """The run's Accelerator, after check_launch."""
    # CPU process groups need gloo (DeepSpeed would otherwise ask for a GPU backend); a single process
    # must get no backend at all, or accelerate expects a process group that nobody started.
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if multi and not torch.cuda.is_available() else []
    if multi and importlib.util.find_spec("deepspeed") is not None:
        # deepspeed keeps references to the process groups that exist when it is first imported (accelerate's
        # unwrap_model imports it whenever it is installed, DDP runs included) and never drops them: the
        # group then outlives teardown, and its gloo threads are still running at interpreter shutdown,
        # which now and then aborts a finished run (SIGABRT, "terminate called without an active
        # exception"). Imported before the group exists, it holds none.
        importlib.import_module("deepspeed")
    accelerator = Accelerator(mixed_precision=cfg.train.mixed_precision, kwargs_handlers=kwargs)
    check_launch(accelerator.distributed_type)
    return accelerator


def apply_plan(accelerator: Accelerator, plan: Plan, cfg: RunConfig) -> None:
    """Accumulation for accelerate, and DeepSpeed's batch sizes (and `auto` clipping) from the plan."""
    accelerator.gradient_accumulation_steps = plan.accum
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds_cfg = plugin.deepspeed_config
    ds_cfg["train_micro_batch_size_per_gpu"] = plan.batch_size
    ds_cfg["gradient_accumulation_steps"] = plan.accum
    ds_cfg["train_batch_size"] = plan.global_batch
    if ds_cfg.get("gradient_clipping") == "auto":
        ds_cfg["gradient_clipping"] = cfg.optim.grad_clip


def teardown(accelerator: Accelerator) -> None:
    """Wait for every rank, release the run's models, end the process groups, and stop telling
    transformers "DeepSpeed".

    The groups must end here, while the interpreter is whole: a group that survives into interpreter
    shutdown still has its gloo threads running there, which now and then aborts a finished run (SIGABRT,
    "terminate called without an active exception"). destroy_process_group only drops torch's own
    references, so the others go first: the caller's Run (gone by now), accelerate's prepared objects (DDP
    holds the group), DeepSpeed's cached subgroups (deepspeed.comm's destroy drops them), and what deepspeed
    takes on import (make_accelerator imports it before the group exists).
    Under ZeRO-3 DeepSpeed still holds its engine, and with it the groups, until exit.
    """
    accelerator.wait_for_everyone()
    accelerator.free_memory()  # accelerate's references to the prepared model / optimizer / DeepSpeed engine
    gc.collect()  # free_memory collects before it drops its lists; DDP sits in reference cycles
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ds_comm = sys.modules.get("deepspeed.comm")
        if ds_comm is not None and ds_comm.is_initialized():
            ds_comm.destroy_process_group()  # also drops the subgroups DeepSpeed caches (deepspeed.utils.groups)
        else:
            torch.distributed.destroy_process_group()
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        # accelerate told transformers "DeepSpeed"; a later model load in this process (eval_at_end)
        # must build an ordinary model.
        unset_hf_deepspeed_config()
