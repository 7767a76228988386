"""Where the frozen target lives during training, under each launcher (used by train/loop.py).

    from train.placement import load_frozen_target
    frozen = load_frozen_target(cfg, accelerator, online=True)   # frozen.model, .tokenizer, .io, .stats()

The target has two jobs in a run: (1) with online features it runs its decoder over every batch to produce
the hidden states the head learns from; (2) every head's loss calls a few of its pieces directly: the
embedding, the lm_head (the loss backpropagates THROUGH it into the head), the final norm, the rotary
module, and for MTP the last decoder layer as a template (heads.base.TargetIO).

| launcher (configs/accelerate/)  | decoder stack (online features)             | TargetIO pieces |
|---------------------------------|---------------------------------------------|-----------------|
| single process, ddp.yaml, ZeRO-2 | replicated: every process holds all of it  | replicated      |
| deepspeed_zero3.yaml (ZeRO-3)   | sharded: built partitioned (zero.Init), run  | replicated      |
|                                 | inside a DeepSpeed ZeRO-3 engine with no     |                 |
|                                 | optimizer that gathers each layer's weights  |                 |
|                                 | just in time and frees them after            |                 |
| fsdp.yaml (FSDP2, GPUs only)    | sharded: fully_shard on every decoder layer  | replicated      |
| features.mode=offline (any)     | not loaded (the store holds the features)    | replicated      |

The pieces stay whole on every process because heads call them outside any engine and every step needs
them; they are the embedding and lm_head matrices plus one layer, which is also all an offline run keeps.
Under ZeRO-3 even an offline run builds the target partitioned, copies the pieces out, and drops the
rest, so no process ever holds a whole big target.

FSDP2 shards the decoder layers only, each its own unit: sharding the root too would turn the embedding
and lm_head into DTensors that fail when the loss calls them outside the root's forward. Under FSDP the
last decoder layer in TargetIO is a whole copy taken before sharding (MTP deep-copies it as a template).

Tiny in-process targets (tiny-random-*) are built whole from their fixed seed and partitioned afterwards:
DeepSpeed's partitioned construction draws the random weights in another order, and a tiny target must
be the same model under every launcher.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch import nn
from transformers.integrations import unset_hf_deepspeed_config

from data.config import ConfigError, RunConfig
from data.target import TINY_NAMES, decoder_layers, final_norm, load_model, load_tokenizer, target_io
from heads.base import TargetIO


@dataclass
class FrozenTarget:
    """The frozen target of a run: `model` computes online features (None offline), `io` feeds the loss."""

    model: nn.Module | None
    tokenizer: Any
    io: TargetIO
    placement: str  # of the decoder stack: "replicated" | "zero3" | "fsdp" | "none" (offline: not kept)
    layer_params: int  # elements in the decoder layers' weights (0 when the model is not kept)
    layer_params_local: int  # of those, the elements this process stores
    engine: Any = None  # ZeRO-3: the target's DeepSpeed engine, held for the run (its teardown drops the hooks)

    def stats(self) -> dict[str, Any]:
        """For the run's `start` event in metrics.jsonl."""
        return {"target_placement": self.placement, "target_layer_params": self.layer_params,
                "target_layer_params_local": self.layer_params_local}


def _local_numel(p: torch.Tensor) -> int:
    """Elements of `p` this process stores: its ZeRO-3 partition, its FSDP shard, or all of it."""
    if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 partitioned parameter
        return int(p.ds_tensor.numel())
    local = getattr(p, "to_local", None)  # FSDP2 DTensor
    return int(local().numel()) if callable(local) else int(p.numel())


def _full_numel(p: torch.Tensor) -> int:
    return int(p.ds_numel) if hasattr(p, "ds_numel") else int(p.numel())


def layer_param_counts(model: nn.Module) -> tuple[int, int]:
    """(all elements, elements stored here) of the target's decoder-layer weights."""
    params = list(decoder_layers(model).parameters())
    return sum(_full_numel(p) for p in params), sum(_local_numel(p) for p in params)


@contextmanager
def _whole_models(plugin: Any) -> Iterator[None]:
    """Inside the block transformers builds models whole, even under a ZeRO-3 config.

    accelerate registers its DeepSpeed config with transformers whenever a DeepSpeed plugin is active, and
    transformers then builds every model partitioned (under zero.Init) when that config says stage 3,
    whatever `zero3_init_flag` says. Unset the registration for the block, restore it after.
    """
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def _replicated_io(model: nn.Module, name: str) -> TargetIO:
    """TargetIO whose pieces are whole, ordinary copies of a ZeRO-3 partitioned model's pieces."""
    import deepspeed  # optional dependency (the deepspeed extra), needed by ZeRO-3 runs only

    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    pieces = {"embed": model.get_input_embeddings(), "lm_head": model.get_output_embeddings(),
              "norm": final_norm(model), "last_layer": decoder_layers(model)[-1]}
    if getattr(base, "rotary_emb", None) is not None:
        pieces["rotary"] = base.rotary_emb
    holder = nn.ModuleDict(pieces)
    with deepspeed.zero.GatheredParameters(list(holder.parameters()), modifier_rank=None):
        io = target_io(model, name)  # its fingerprint reads the embedding, whole only inside this block
        # Copied in one deepcopy so that a tied embedding / lm_head stays one tensor in the copy.
        whole = copy.deepcopy(holder)
    return replace(io, **{k: whole[k] for k in pieces})


def shard_layers_fsdp(model: nn.Module) -> None:
    """FSDP2-shard every decoder layer of a frozen target in place (run on every process of the group).

    reshard_after_forward must be given: a layer that runs without a wrapped parent is its own FSDP root,
    and roots otherwise keep their gathered weights after the first forward (the whole target again).
    """
    # torch.distributed.fsdp has fully_shard from torch 2.6 on (the project allows 2.4): FSDP runs only
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=True)


def load_frozen_target(cfg: RunConfig, accelerator: Any, online: bool) -> FrozenTarget:
    """Load cfg.target for training and place it as the table in the module docstring says."""
    if cfg.target.device_map:
        # Heads call the embedding and lm_head on the training device; a device map would scatter them.
        raise ConfigError(f"target.device_map '{cfg.target.device_map}' is for extraction (python -m data.extract); "
                          f"training places the target itself: use ZeRO-3 or FSDP to shard a big one")
    tcfg = replace(cfg.target, device=str(accelerator.device))
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    zero3 = plugin is not None and int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)) == 3
    tok = load_tokenizer(tcfg)
    if zero3:
        import deepspeed  # optional dependency (the deepspeed extra), needed by ZeRO-3 runs only

        if tcfg.name_or_path in TINY_NAMES:
            with _whole_models(plugin):
                model = load_model(tcfg)
            deepspeed.zero.Init(module=model, config_dict_or_path=_target_ds_config(plugin))
        else:
            model = load_model(tcfg)  # partitioned as it loads: accelerate told transformers "ZeRO-3"
        io = _replicated_io(model, tcfg.name_or_path)
        if not online:
            return FrozenTarget(None, tok, io, "none", 0, 0)
        # An engine without optimizer: its hooks gather each module's partition for its forward.
        engine, *_ = deepspeed.initialize(model=model, config=_target_ds_config(plugin))
        full, local = layer_param_counts(model)
        return FrozenTarget(model, tok, io, "zero3", full, local, engine)
    model = load_model(tcfg)  # whole: only a stage-3 DeepSpeed config makes transformers partition it
    io = target_io(model, tcfg.name_or_path)
    if not online:
        layers = decoder_layers(model)
        del layers[: len(layers) - 1]  # io.last_layer still points at the last one
        return FrozenTarget(None, tok, io, "none", 0, 0)
    if accelerator.distributed_type == DistributedType.FSDP:
        io = replace(io, last_layer=copy.deepcopy(io.last_layer))
        shard_layers_fsdp(model)
        full, local = layer_param_counts(model)
        return FrozenTarget(model, tok, io, "fsdp", full, local)
    full, local = layer_param_counts(model)
    return FrozenTarget(model, tok, io, "replicated", full, local)


def _target_ds_config(plugin: Any) -> dict[str, Any]:
    """The run's ZeRO-3 settings for the target's own, optimizer-free engine (its dtype is left alone)."""
    zero = dict(plugin.deepspeed_config["zero_optimization"])
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "steps_per_print": 1_000_000_000}
