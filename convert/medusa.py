"""Medusa heads <-> the Medusa repository's layout (medusa_lm_head.safetensors + config.json).

Native `blocks.{h}.layers.{i}.*` <-> `{h}.{i}.linear.*` and `lm_heads.{h}.weight` <-> `{h}.{N}.weight`
(N residual blocks per head). vLLM's own Medusa model expects other names and config, so vLLM does not
serve this export.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from convert.common import head_state
from convert.family import FamilyExports, Layout
from convert.spec import ExportError
from heads import registry
from heads.base import HeadConfig, TargetIO

NATIVE_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
NATIVE_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


def export_medusa(head: nn.Module, cfg: HeadConfig, meta: dict, target: TargetIO, verifier: str,
                  speculative_tokens: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Native `blocks.{h}.layers.{i}.*` -> `{h}.{i}.linear.*`, `lm_heads.{h}.weight` -> `{h}.{N}.weight`."""
    n = int(cfg.num_layers)
    weights = {}
    for k, v in head_state(head).items():
        if m := NATIVE_BLOCK.match(k):
            weights[f"{m[1]}.{m[2]}.linear.{m[3]}"] = v
        elif m := NATIVE_HEAD.match(k):
            weights[f"{m[1]}.{n}.weight"] = v
        else:
            raise ExportError(f"medusa head: parameter '{k}' has no place in the Medusa layout")
    config = {
        "medusa_num_heads": int(cfg.num_heads),
        "medusa_num_layers": n,
        "base_model_name_or_path": verifier,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
    }
    return config, weights


def import_medusa(config: dict, state: dict[str, torch.Tensor], target: TargetIO, where: str
                  ) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    cfg = registry.get("medusa").config(
        num_heads=int(config["medusa_num_heads"]), num_layers=int(config["medusa_num_layers"])
    )
    n = cfg.num_layers
    native = {}
    for k, v in state.items():
        h, i, rest = k.split(".", 2)
        if int(i) == n:
            native[f"lm_heads.{h}.weight"] = v
        else:
            native[f"blocks.{h}.layers.{i}.{rest.removeprefix('linear.')}"] = v
    return cfg, native


SERVING = """The root holds the Medusa repository layout (`medusa_lm_head.safetensors`), loaded by the Medusa
repository's own code with this target. vLLM's Medusa model expects other names and config keys
(`blocks.{h}.layers.{i}`, `lm_heads.{h}`, `num_heads`: the names in `draftheads/model.safetensors`);
SGLang has no Medusa support."""

EXPORTS = FamilyExports(
    family="medusa",
    layouts=(Layout("medusa", export_medusa, import_medusa),),
    not_served="exported in the Medusa repository's layout; vLLM's Medusa model expects other names and config",
    serving=lambda repo_id, target_hub, k, layouts: SERVING,
)
