"""What each head family declares about export: the engine layouts it converts to and what serves it.

A family with an engine layout (or a serving note of its own) has one module here, convert/<family>.py,
ending in

    EXPORTS = FamilyExports(family="...", layouts=(Layout("fmt", export_fn, import_fn), ...),
                            vllm=VllmServing(...) or None, not_served="why vLLM cannot serve it",
                            serving=a function writing the model card's serving commands)

and convert/registry.py finds them (every convert module defining EXPORTS; a native-only family needs none);
nothing outside convert/ names a family's layouts. A Layout's `format` names its written specification,
convert/formats/<format>.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from heads.base import HeadConfig, TargetIO

# (head, its config, its config.json record, target, verifier Hub id, speculative tokens) -> (config, weights)
ExportFn = Callable[[nn.Module, HeadConfig, dict, TargetIO, str, int], tuple[dict, dict[str, torch.Tensor]]]
# (config, weights, target, where) -> (native head config, native state dict)
ImportFn = Callable[[dict, dict[str, torch.Tensor], TargetIO, str], tuple[HeadConfig, dict[str, torch.Tensor]]]
# (Hub repo id of the upload, the target's Hub id, draft length k, the engine layouts the upload holds, its
# root's first: () for native only) -> the model card's "Serving" text
ServingFn = Callable[[str, str, int, tuple[str, ...]], str]


@dataclass(frozen=True)
class Layout:
    """One engine layout: its format name, the converters to and from the native head, and which heads of the
    family it is for: `refuses(head_config)` (the native config.json's `head_config`) is "" for a head it holds,
    else the one-line reason it cannot (convert.api.build_export raises it; all heads by default)."""

    format: str
    export: ExportFn
    import_: ImportFn
    refuses: Callable[[dict], str] = lambda head_config: ""

    def applies(self, head_config: dict) -> bool:
        """Whether a head with this `head_config` can be exported to this layout."""
        return not self.refuses(head_config)


class VllmServing(NamedTuple):
    """How vLLM serves a family: the layout to export to and vLLM's speculative_config `method`."""

    format: str
    method: str


@dataclass(frozen=True)
class FamilyExports:
    """A family's export declaration; `layouts[0]` is its main layout (the root of a Hub upload)."""

    family: str
    layouts: tuple[Layout, ...] = ()
    vllm: VllmServing | None = None
    not_served: str = ""  # why vLLM does not serve this family (when vllm is None)
    serving: ServingFn | None = None  # how to serve an upload (scripts/publish.py); None: evaluate it here only
