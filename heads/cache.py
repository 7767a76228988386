"""The one KV cache every drafter in heads/ keeps: transformers' `DynamicCache`, plus the two version shims it needs.

    cache = DynamicCache()               # built without a config: every layer a full DynamicLayer
    keys, values = cache.update(k, v, 0) # append rows (the EAGLE drafter's re-implemented layer calls this)
    block(x, **{cache_kwarg(block): cache})   # a transformers decoder layer appends to it itself (MTP)
    cache_length(cache)                  # rows held (by the filled layer, whatever its index)
    crop_to(cache, n)                    # keep the first n rows of every layer: drop draft rows after a draft
    tree_mask(past, ancestors, positions, dtype, window=w)   # the additive mask of new rows (additive_mask: the
                                         # one mask builder, the decoder's caches and the MTP drafter alike)
    keys, values, seen = pad_requests([(k, v) per request])   # side by side, padded: drafting rows together

Why these shims: transformers renamed the forward argument `past_key_values` to `cache` between 5.17 (the GPU
image) and 5.24 (pinned here), and silently ignores the wrong name; and `crop(n)` with n > 0 was a target LENGTH in
older releases (5.24 calls it the legacy path and refuses it), while crop(-r) removes r rows in every version:
`crop_to` therefore only ever removes a positive number of rows, layer by layer, and leaves unfilled layers alone
(a copied target block appends at its own layer index, so its cache holds empty layers below that index).

The drafters build `DynamicCache()` themselves (EAGLE: one for the head's layer; MTP: one per step). Built
without a config, no layer is a sliding-window layer: sliding-window blocks get their window from the
attention mask the drafter passes, never from the cache, so every row stays until the drafter crops it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # heads.base re-exports cache_kwarg, and config parsing imports heads.base: no transformers here
    from transformers import DynamicCache


def cache_length(cache: DynamicCache) -> int:
    """Rows the cache holds: the longest layer (the one a single-layer drafter fills)."""
    return max((layer.get_seq_length() for layer in cache.layers), default=0)


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` rows of every layer (a layer holding no more is left as it is)."""
    for layer in cache.layers:
        remove = layer.get_seq_length() - length
        if remove > 0:
            layer.crop(-remove)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, q_pos: torch.Tensor | None = None,
                  k_pos: torch.Tensor | None = None, window: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The one attention-mask builder: bool `allowed` [q, K] -> additive mask [1, 1, q, K] of `dtype` (0 = attend,
    dtype's min = blocked; eager and SDPA read it alike), or per request [B, q, K] -> [B, 1, q, K]. With a
    `window` (a sliding-window layer) a key more than window - 1 positions before its query is blocked too:
    positions q_pos [q] and k_pos [K] (per request: [B, q] and [B, K]). `out`, a buffer of the result's shape
    (a static cache's, replayed by a CUDA graph), is written in place and returned."""
    if window is not None:
        allowed = allowed & ((q_pos[..., :, None] - k_pos[..., None, :]) < window)
    shape = (1, 1, *allowed.shape) if allowed.dim() == 2 else (allowed.shape[0], 1, *allowed.shape[1:])
    out = torch.zeros(shape, dtype=dtype, device=allowed.device) if out is None else out.zero_()
    return out.masked_fill_(~allowed.reshape(shape), torch.finfo(dtype).min)


def pad_requests(parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor]:
    """Several requests' keys and values [1, kv heads, n_i, d] each (None: none yet; at least one given) side by
    side, zero-padded to the longest: keys, values [requests, kv heads, longest, d] and seen [requests, longest]
    (True where a key is the request's own). What the drafters attend over when they draft the batched
    decoder's rows together (heads.eagle, heads.dflash, heads.mtp)."""
    k0 = next(p[0] for p in parts if p is not None)
    lengths = [0 if p is None else p[0].shape[2] for p in parts]
    keys = k0.new_zeros(len(parts), k0.shape[1], max(lengths), k0.shape[-1])
    vals = torch.zeros_like(keys)
    seen = torch.zeros(len(parts), max(lengths), dtype=torch.bool, device=k0.device)
    for i, (p, n) in enumerate(zip(parts, lengths)):
        if p is not None:
            keys[i, :, :n], vals[i, :, :n], seen[i, :n] = p[0][0], p[1][0], True
    return keys, vals, seen


def tree_mask(past: int, ancestors: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
              width: int | None = None, window: int | None = None,
              out: torch.Tensor | dict[str, torch.Tensor] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask of q new rows after `past` committed ones: row i sees every committed key and, among the new
    rows, those `ancestors` [q, q] marks (itself included; a lower triangle for a chain). Keys from past + q on
    (a static cache's unused slots, up to `width`) are blocked. positions [q] are the new rows' positions.

    Without a window one mask [1, 1, q, width]; with one, transformers' pair for mixed models:
    {"full_attention": ..., "sliding_attention": ...}. `out` (the same structure) is filled in place.
    """
    q = ancestors.shape[0]
    width = past + q if width is None else width
    allowed = torch.zeros(q, width, dtype=torch.bool, device=ancestors.device)
    allowed[:, :past] = True
    allowed[:, past:past + q] = ancestors
    full_out = out["full_attention"] if isinstance(out, dict) else out
    full = additive_mask(allowed, dtype, out=full_out)
    if window is None:
        return full
    k_pos = torch.arange(width, device=ancestors.device)
    k_pos[past:past + q] = positions
    sliding = additive_mask(allowed, dtype, positions, k_pos, window,
                            out=out["sliding_attention"] if isinstance(out, dict) else None)
    return {"full_attention": full, "sliding_attention": sliding}


def cache_kwarg(module: nn.Module) -> str:
    """The name of a model's or decoder layer's cache argument: `cache` (transformers >= 5.2x) or
    `past_key_values` (5.17, which takes **kwargs and silently ignores `cache=`: no cache would be used)."""
    return _cache_kwarg_of(type(module))


@functools.cache
def _cache_kwarg_of(cls: type) -> str:  # per class: drafters ask once per draft step
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
