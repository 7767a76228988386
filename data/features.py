"""Capture target features in one forward pass: the requested decoder-layer inputs plus the final hidden.

Used by extraction (data.extract), the online feature stream, and the speculative decoder, so all three
see exactly the same tensors.

Convention (see heads/base.py): index i means transformers' `hidden_states[i]`, i.e. the residual stream
at the INPUT of decoder layer i (index 0 is the embedding output). Only the asked layers are kept: hooks on
the decoder layers copy their inputs, so the L+1 hidden states are never all held in memory. `last` is the
output of the target's final norm (what lm_head reads); logits are computed only when asked for, and
`greedy_ids` gives the target's argmax from `last` a chunk of rows at a time (the store keeps those ids).

    with FeatureCapture(model, layer_ids=[2, 15, 27]) as cap:
        out = model(input_ids=ids, cache=cache, use_cache=True)
    feats = cap.features()          # Features(last [B,T,H], aux [B,T,3H])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from data.target import decoder_layers, final_norm, text_config
from heads.base import Features


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, where: str = "layer_ids") -> list[int]:
    """Validate hidden_states indices: 0 <= i < num_layers, ascending, no duplicates."""
    ids = list(layer_ids)
    for i in ids:
        if not 0 <= int(i) < num_layers:
            raise ValueError(f"{where}: hidden_states index {i} is outside 0..{num_layers - 1} for this target")
    if ids != sorted(set(ids)):
        raise ValueError(f"{where}: {ids} must be ascending without duplicates")
    return ids


class FeatureCapture:
    """Context manager: hooks that record decoder-layer inputs and the final-norm output of `model`."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] = ()):
        self.layers = decoder_layers(model)
        self.norm = final_norm(model)
        self.layer_ids = check_layer_ids(layer_ids, text_config(model.config).num_hidden_layers)
        self._aux: dict[int, torch.Tensor] = {}
        self._last: torch.Tensor | None = None
        self._handles: list[Any] = []

    def _pre_hook(self, idx: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            self._aux[idx] = h.detach()

        return hook

    def _norm_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._last = (output[0] if isinstance(output, tuple) else output).detach()

    def __enter__(self) -> FeatureCapture:
        for i in self.layer_ids:
            self._handles.append(self.layers[i].register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
        self._handles.append(self.norm.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def features(self) -> Features:
        """The features of the last forward pass run inside the context."""
        if self._last is None:
            raise RuntimeError("FeatureCapture: no forward pass was recorded")
        # With a device map (target.device_map) the layers sit on different GPUs: gather where `last` is.
        dev = self._last.device
        aux = torch.cat([self._aux[i].to(dev) for i in self.layer_ids], dim=-1) if self.layer_ids else None
        feats = Features(last=self._last, aux=aux)
        self._aux, self._last = {}, None
        return feats


@torch.no_grad()
def forward_features(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layer_ids: Sequence[int] = (),
    with_logits: bool = False,
) -> tuple[Features, torch.Tensor | None]:
    """One forward pass over a batch: (features, logits or None).

    Without logits only the decoder runs (the lm_head matmul is skipped); trainers recompute logits from
    `last` with the target's lm_head.
    """
    with FeatureCapture(model, layer_ids) as cap:
        if with_logits:
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        else:
            base = model.get_decoder() if hasattr(model, "get_decoder") else model
            base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            logits = None
    return cap.features(), logits


@torch.no_grad()
def greedy_ids(model: nn.Module, last: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The target's argmax next token at every position of `last` [..., H], as int32 [...].

    Rows go through the output projection `chunk` at a time, so a large vocabulary never needs a whole
    batch of full-vocab logits in memory.
    """
    head = model.get_output_embeddings()
    w = next(head.parameters())
    flat = last.reshape(-1, last.shape[-1])
    out = [head(flat[i: i + chunk].to(w.device, w.dtype)).argmax(-1) for i in range(0, flat.shape[0], chunk)]
    ids = torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=w.device)
    return ids.to(torch.int32).reshape(last.shape[:-1])
