"""MTP heads <-> the DeepSeek-V3 MTP layout (`model.layers.{L+k}.*`), adapted to the target's decoder layer.

vLLM serves MTP modules only inside DeepSeek-style target checkpoints, so it does not serve this export
for other targets; the layout keeps DeepSeek's names so an MTP-capable loader needs only its block class.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from convert.common import causal_lm_architecture, head_state
from convert.family import FamilyExports, Layout
from convert.spec import ExportError
from heads import registry
from heads.base import HeadConfig, HeadMismatchError, TargetIO

# Tensors of every module that are copies of the target's own (the importer checks and drops them).
TARGET_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
OWN_KEYS = ("enorm", "hnorm", "eh_proj")


def export_mtp(head: nn.Module, cfg: HeadConfig, meta: dict, target: TargetIO, verifier: str,
               speculative_tokens: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Native `mtp.{k}.*` -> `model.layers.{L+k}.*`; the target's embedding and lm_head are copied in.

    Mapping per module k (L = the target's num_hidden_layers): enorm/hnorm/eh_proj keep their names,
    `mtp.{k}.block.X` -> `model.layers.{L+k}.X` (the decoder layer's own names), `mtp.{k}.norm.weight` ->
    `model.layers.{L+k}.shared_head.norm.weight`; `shared_head.head.weight` = the target's lm_head and
    `embed_tokens.weight` = the target's embedding, as in DeepSeek-V3's checkpoint.
    """
    L = target.num_layers
    state = head_state(head)
    dtype = state["mtp.0.eh_proj.weight"].dtype
    emb = target.embed.weight.detach().cpu().to(dtype).contiguous()
    lm = target.lm_head.weight.detach().cpu().to(dtype).contiguous()
    weights: dict[str, torch.Tensor] = {}
    n_modules = 1 + max(int(k.split(".")[1]) for k in state)
    for k, v in state.items():
        _, idx, rest = k.split(".", 2)
        p = f"model.layers.{L + int(idx)}."
        if rest.startswith("block."):
            weights[p + rest[len("block."):]] = v
        elif rest == "norm.weight":
            weights[p + "shared_head.norm.weight"] = v
        elif rest.split(".")[0] in OWN_KEYS:
            weights[p + rest] = v
        else:
            raise ExportError(f"mtp head: parameter '{k}' has no place in the DeepSeek MTP layout")
    for idx in range(n_modules):
        weights[f"model.layers.{L + idx}.embed_tokens.weight"] = emb.clone()  # safetensors refuses shared storage
        weights[f"model.layers.{L + idx}.shared_head.head.weight"] = lm.clone()
    config = {k: v for k, v in target.config.to_dict().items() if not k.startswith("_")}
    config.update(
        architectures=causal_lm_architecture(target.config),
        num_nextn_predict_layers=n_modules,
        draftheads_mtp={"recursive": bool(cfg.recursive), "num_steps": int(cfg.num_steps)},
    )
    return config, weights


def import_mtp(config: dict, state: dict[str, torch.Tensor], target: TargetIO, where: str
               ) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    L, K = int(config["num_hidden_layers"]), int(config["num_nextn_predict_layers"])
    if L != target.num_layers:
        raise HeadMismatchError(f"{where}: num_hidden_layers is {L} but the target has {target.num_layers}")
    extra = config.get("draftheads_mtp", {})
    cfg = registry.get("mtp").config(
        num_modules=K, recursive=bool(extra.get("recursive", False)), num_steps=int(extra.get("num_steps", 3))
    )
    if cfg.recursive and K != 1:
        raise ExportError(f"{where}: draftheads_mtp.recursive needs num_nextn_predict_layers 1, got {K}")
    # The native head uses the target's embedding and lm_head: a checkpoint holding other tensors there
    # would decode differently here than in the engine, so it is refused rather than silently replaced.
    for k in range(K):
        p = f"model.layers.{L + k}."
        for name, own in zip(TARGET_COPIES, (target.embed.weight, target.lm_head.weight)):
            w = state[p + name]
            if not torch.equal(w, own.detach().cpu().to(w.dtype)):
                raise HeadMismatchError(f"{where}: {p}{name} differs from the target's (not made for this target)")
    native = {}
    for key, v in state.items():
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", key)
        idx, rest = int(m[1]) - L, m[2]
        if rest in TARGET_COPIES:
            continue
        if rest == "shared_head.norm.weight":
            native[f"mtp.{idx}.norm.weight"] = v
        elif rest.split(".")[0] in OWN_KEYS:
            native[f"mtp.{idx}.{rest}"] = v
        else:
            native[f"mtp.{idx}.block.{rest}"] = v
    return cfg, native


SERVING = """The root holds the DeepSeek-V3 MTP layout (`model.layers.{L+k}.*`, `num_nextn_predict_layers`)
adapted to this target's own decoder layer. vLLM and SGLang serve MTP modules for DeepSeek-style
architectures only; for this target use an MTP-capable loader with the target's decoder-layer class."""

EXPORTS = FamilyExports(
    family="mtp",
    layouts=(Layout("mtp", export_mtp, import_mtp),),
    not_served="vLLM serves MTP modules only inside DeepSeek-style target checkpoints",
    serving=lambda repo_id, target_hub, k, layouts: SERVING,
)
