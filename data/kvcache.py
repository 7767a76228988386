"""The one KV-cache protocol of a causal LM: dynamic (transformers' DynamicCache) or static (preallocated,
fixed-size forwards, captured as CUDA graphs on CUDA). The speculative decoder and plain decoding
(eval.decoder), the verify-cost probe (eval.costs), the draft models (eval.drafters), the batch sweep
(eval.batch) and generation (data.regenerate) all decode through it, so the loops run unchanged on either:

    kv = new_kv(model, "static", capture=(2, 16, 29), room=prompt_len + max_new_tokens + k + 1)
    logits, feats = kv.run(ids)          # ids [1, q]: q new rows after the kv.length committed ones (chain)
    logits, feats = kv.run(ids, parents) # rows 1..q-1 form a tree below row 0 (heads.tree conventions)
    kv.keep([0, 2, 3])                   # commit these new rows, packed in order; the others are dropped
    kv.truncate(n)                       # forget committed rows past the first n
    ids, mask = left_pad(rows, pad_id); kv = DynamicKV(model); kv.run(ids, pad=mask)  # B left-padded rows
                                         # (batch sweep, generation; see DynamicKV)
    kv.run(block, parents=P); kv.keep_rows(paths)   # B rows, a tree each (P [B, q-1]), each keeping its own path

The heads' own drafters (heads/) are not causal LMs and keep a DynamicCache directly, through the same
shims (heads.cache: the cache argument's name, cropping, and `tree_mask`, the one mask builder used here too).
Run its tests: .venv/bin/python -m pytest -q tests/test_decoder.py -k cache

`logits` [1, q, V] (or [1, 1, V] with logits_to_keep=1) and `feats` (the `capture` layers, see
data.features) of a static cache are its own buffers: read them before the next `run`.

Static cache (`StaticKV`): every layer's keys/values are preallocated to `max_len` slots; new rows are written
at the slots the cache names (committed length + row index), never at a running counter, so a rollback is host
bookkeeping plus, for an accepted tree path that is not a prefix, one gather per layer. Every forward gets an
explicit additive mask over all `max_len` slots (row i sees the committed slots and its own ancestors among the
new rows; sliding-window layers also the window) and explicit positions, so transformers' mask creation is
skipped and stale slots never leak. On CUDA each input size q is captured once as a CUDA graph (static input
buffers, shared memory pool) and replayed; the small host inputs go through pinned staging buffers, so a pass
issues no host synchronisation of its own: the caller's read of the logits (the acceptance decision) is the one.
Room runs out -> the cache grows (doubling, graphs recaptured), so `room` is a hint, not a limit. The prefill
(the first run on an empty cache) runs eagerly with a [T, max_len] mask: fine for prompts of a few thousand
tokens, not for very long ones.

transformers renamed the forward argument `past_key_values` to `cache` between 5.17 (the GPU image) and 5.24
(pinned here); passing the wrong name is silently ignored (the model builds a private cache), so every call
here goes through `cache_kwarg`.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from data.features import FeatureCapture
from data.target import text_config
from heads.base import Features, cache_kwarg
from heads.cache import additive_mask, tree_mask
from heads.tree import is_chain, tree_layout

__all__ = ["CACHE_KINDS", "DynamicKV", "KVCache", "StaticKV", "new_kv", "rollback_cache", "sliding_window"]

CACHE_KINDS = ("dynamic", "static")
GRAPH_MAX_ROWS = 128  # forwards of at most this many rows are captured as CUDA graphs (verify sizes, not prompts)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token rows: (input_ids [B, L], attention_mask [B, L] with 1 on real tokens).

    Example: rows [[5, 6, 7], [8]], pad 0 -> ids [[5, 6, 7], [0, 0, 8]], mask [[1, 1, 1], [0, 0, 1]].
    """
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("left_pad needs non-empty rows")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def sliding_window(model: nn.Module) -> int | None:
    """The window of the model's sliding-attention layers, None when every layer attends fully."""
    cfg = text_config(model.config)
    types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    return int(window) if window and "sliding_attention" in types else None


def rollback_cache(cache: DynamicCache, base: int, n_new: int, keep: Sequence[int]) -> None:
    """Keep `keep` of the last n_new cache slots (slot base + j for j in keep), packed in order at base.

    Before: the cache holds base + n_new tokens. After: base + len(keep), where slot base + m holds what slot
    base + keep[m] held. Example: base 10, n_new 4, keep [1, 3] -> slots 10, 11 take old 11 and 13, length 12.
    A prefix keep [0, ..., m-1] (every chain) is a plain crop; otherwise the K/V rows are gathered first.
    The gathered K/V are exactly the ones a sequential pass would have produced: each accepted node was
    computed at its path position while seeing only the cache, the root and its own ancestors.
    """
    _gather(cache.layers, base, keep)
    if n_new > len(keep):
        cache.crop(-(n_new - len(keep)))


def _gather(layers: Sequence[Any], base: int, keep: Sequence[int]) -> None:
    """Move slots base + keep[m] to base + m in every layer (nothing to do for a prefix keep)."""
    m = len(keep)
    if m and list(keep) != list(range(m)):
        src = torch.as_tensor(list(keep), dtype=torch.long) + base
        for layer in layers:
            idx = src.to(layer.keys.device)
            layer.keys[:, :, base:base + m] = layer.keys.index_select(2, idx)
            layer.values[:, :, base:base + m] = layer.values.index_select(2, idx)


class KVCache(Protocol):
    """What the decoder and the draft model ask of a cache (see the module docstring).

    The logits and features a `run` returns are valid until the next `run`: a static cache on CUDA replays its
    graph into the same output buffers, so whoever keeps features for longer copies them (eval.drafters'
    deferred commits do)."""

    length: int  # committed rows

    def run(self, ids: torch.Tensor, parents: torch.Tensor | None = None, logits_to_keep: int = 0,
            pad: torch.Tensor | None = None) -> tuple[torch.Tensor, Features | None]: ...

    def keep(self, rows: Sequence[int]) -> None: ...

    def truncate(self, length: int) -> None: ...


# ----------------------------------------------------------------------------------------------- dynamic
class DynamicKV:
    """transformers' DynamicCache, built without the model config so every layer is a full DynamicLayer that can be
    cropped at any length; sliding-window layers get their window from the mask (trees) or the model (chains).

    Batches (B rows: the batch sweep, generation) may be left padded: the first pass gives `pad`, its [B, T]
    attention mask (0 = padding), and the cache keeps the mask of its committed rows, so every pass sees the
    committed mask plus its new rows and positions that count real tokens only (a padded row's first real token
    is position 0, as alone, which keeps batched output equal to one-at-a-time output). `select(rows)` drops
    the other rows of a batch (rows that finished). windowed=True builds the layers from the model config
    instead: transformers' own sliding-window layers, which keep only their window (generation, which only
    ever appends; such a cache is never truncated or rolled back).
    """

    def __init__(self, model: nn.Module, capture: Sequence[int] | None = None, windowed: bool = False):
        self.model, self.capture = model, capture
        # One capture for the cache's life, its hooks registered around each forward only: resolving the layers
        # every pass cost ~0.1 ms, a fifth of what a drafting-off pass added to a plain one (docs/batching.md).
        self._capture = None if capture is None else FeatureCapture(model, capture)
        self.cache = DynamicCache(config=model.config) if windowed else DynamicCache()
        self.key = cache_kwarg(model)
        self.window = sliding_window(model)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.length = 0
        self._pending = 0
        self.padding: torch.Tensor | None = None  # [B, length] attention mask of the committed rows, once padded
        self._new_pad: torch.Tensor | None = None  # the last pass's rows' mask, until keep

    def _forward(self, ids: torch.Tensor, logits_to_keep: int, **kw: Any) -> tuple[torch.Tensor, Features | None]:
        kw = {self.key: self.cache, "use_cache": True, "logits_to_keep": logits_to_keep, **kw}
        if self._capture is None:
            return self.model(input_ids=ids, **kw).logits, None
        with self._capture as cap:
            out = self.model(input_ids=ids, **kw)
        return out.logits, cap.features()

    @torch.no_grad()
    def run(self, ids: torch.Tensor, parents: torch.Tensor | None = None, logits_to_keep: int = 0,
            pad: torch.Tensor | None = None) -> tuple[torch.Tensor, Features | None]:
        ids = ids.to(self.device)
        self._pending = ids.shape[1]
        if pad is not None or self.padding is not None:
            return self._padded(ids, logits_to_keep, pad, parents)
        # Without parents (prefill, plain steps, draft models) the model masks itself; a verify pass with
        # sliding-window layers gets the window from our mask even for chains.
        if parents is None or (is_chain(parents) and self.window is None):
            return self._forward(ids, logits_to_keep)
        anc, depths = tree_layout(parents)
        pos = self.length + torch.cat([torch.zeros(1, dtype=torch.long), depths]).to(self.device)
        mask = tree_mask(self.length, anc.to(self.device), pos, self.dtype, window=self.window)
        return self._forward(ids, logits_to_keep, attention_mask=mask, position_ids=pos[None])

    def _padded(self, ids: torch.Tensor, logits_to_keep: int, pad: torch.Tensor | None,
                parents: torch.Tensor | None = None) -> tuple[torch.Tensor, Features | None]:
        """A pass over (left) padded rows: the mask of committed and new rows, positions of real tokens only.

        parents [B, q-1] (row b's tree below its row 0, heads.tree conventions) gives every row its own tree:
        a 4D mask where row b's new row i sees row b's committed real tokens and its own ancestors, at
        position (real tokens committed in row b) + depth. None: the new rows are a chain in every row.
        """
        if pad is not None and self.length:
            raise ValueError("DynamicKV: `pad` belongs to the first pass (the prompts)")
        new = pad.to(self.device) if pad is not None else self.padding.new_ones(ids.shape)
        mask = new if self.padding is None else torch.cat([self.padding, new], dim=1)
        self._new_pad = new
        if parents is None:
            # A row's token at mask column j has position mask[:, :j+1].sum() - 1 (pads take none).
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            return self._forward(ids, logits_to_keep, attention_mask=mask, position_ids=pos)
        if self.padding is None or self.window is not None:
            raise ValueError("DynamicKV: padded trees need committed rows and a model without sliding windows")
        b, q = ids.shape
        allowed = torch.zeros(b, q, self.length + q, dtype=torch.bool, device=self.device)
        allowed[:, :, :self.length] = self.padding.bool()[:, None, :]
        pos = self.padding.sum(-1, keepdim=True).repeat(1, q)  # [B, q]: every row's next real position
        for r in range(b):
            anc, depths = tree_layout(parents[r])
            allowed[r, :, self.length:] = anc.to(self.device)
            pos[r, 1:] += depths.to(self.device)
        masks = additive_mask(allowed, self.dtype)  # [B, 1, q, length + q]
        return self._forward(ids, logits_to_keep, attention_mask=masks, position_ids=pos)

    def keep(self, rows: Sequence[int]) -> None:
        rollback_cache(self.cache, self.length, self._pending, rows)
        if self._new_pad is not None:
            kept = self._new_pad[:, list(rows)]
            self.padding = kept if self.padding is None else torch.cat([self.padding, kept], dim=1)
            self._new_pad = None
        self.length += len(rows)
        self._pending = 0

    def keep_rows(self, paths: Sequence[Sequence[int]]) -> None:
        """Ragged keep for a padded batch: row b keeps the new rows paths[b] (its root and accepted path), packed.

        Every row is given max len(paths) new slots; row b's slots past len(paths[b]) keep whatever was there
        but are masked out of every later pass (padding 0), so each row's cache holds exactly its own
        committed tokens and positions still count real tokens only. Example: paths [[0, 1, 2], [0]] -> three
        new slots per row, row 1's last two masked out. Chain paths are prefixes (a crop, no gather).
        """
        if self.padding is None or len(paths) != self.padding.shape[0]:
            raise ValueError("DynamicKV.keep_rows: one path per row of a padded batch")
        width = max(len(p) for p in paths)
        idx = torch.zeros(len(paths), width, dtype=torch.long)
        kept = torch.zeros(len(paths), width, dtype=self.padding.dtype)
        for r, p in enumerate(paths):
            idx[r, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
            kept[r, :len(p)] = 1
        if any(list(p) != list(range(len(p))) for p in paths):
            for layer in self.cache.layers:
                g = (idx.to(layer.keys.device) + self.length)[:, None, :, None]
                gk = layer.keys.gather(2, g.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
                gv = layer.values.gather(2, g.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
                layer.keys[:, :, self.length:self.length + width] = gk
                layer.values[:, :, self.length:self.length + width] = gv
        if self._pending > width:
            self.cache.crop(-(self._pending - width))
        self.padding = torch.cat([self.padding, kept.to(self.padding.device)], dim=1)
        self._new_pad = None
        self.length += width
        self._pending = 0

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(-(self.length - length))
            self.length = length
            if self.padding is not None:
                self.padding = self.padding[:, :length]

    def fork(self, capture: Sequence[int] | None = None) -> DynamicKV:
        """An independent copy of the committed rows (keys, values, mask) that captures `capture` from then on:
        several runs over the same prompts start from one prefill (eval.batch.SharedPrefill) instead of each
        computing it again (a batch of 16 prompts' prefill cost about as much as the 32 tokens decoded after
        it). Nothing may be pending (a pass not yet kept)."""
        if self._pending:
            raise ValueError("DynamicKV.fork: a pass is pending (keep it first)")
        twin = DynamicKV(self.model, capture)
        twin.cache = copy.deepcopy(self.cache)
        twin.length = self.length
        twin.padding = None if self.padding is None else self.padding.clone()
        return twin

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows of the batch (indices [B'], in this order), in the cache and its mask."""
        self.cache.batch_select_indices(rows)
        if self.padding is not None:
            self.padding = self.padding[rows]


# ----------------------------------------------------------------------------------------------- static
class _SlotLayer(StaticLayer):
    """A StaticLayer that writes new keys/values at the slots its StaticKV names for this forward."""

    def __init__(self, max_cache_len: int, owner: StaticKV):
        super().__init__(max_cache_len=max_cache_len)
        self.owner = owner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.owner.slots
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values


class _Step:
    """The fixed input/output buffers of one forward size q (and, on CUDA, its captured graph)."""

    def __init__(self, q: int, max_len: int, window: int | None, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.q = q
        self.ids = torch.zeros(1, q, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, q, dtype=torch.long, device=device)
        self.slots = torch.arange(q, device=device)
        self.causal = torch.ones(q, q, dtype=torch.bool, device=device).tril_()
        full = torch.zeros(1, 1, q, max_len, dtype=dtype, device=device)
        self.mask: torch.Tensor | dict[str, torch.Tensor] = full
        if window is not None:
            self.mask = {"full_attention": full, "sliding_attention": torch.zeros_like(full)}
        # Host staging: pinned on CUDA so the copies are asynchronous (the event guards reuse).
        self.pin = pin
        self.h_ids = torch.zeros(q, dtype=torch.long, pin_memory=pin)
        self.tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # see tree_buffers
        self.copied = torch.cuda.Event() if pin else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, Features | None] | None = None

    def tree_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(host ancestor mask, host depths, device ancestor mask), made on the first tree of this size."""
        if self.tree is None:
            q, dev = self.q, self.causal.device
            self.tree = (torch.zeros(q, q, dtype=torch.bool, pin_memory=self.pin),
                         torch.zeros(q, dtype=torch.long, pin_memory=self.pin),
                         torch.zeros(q, q, dtype=torch.bool, device=dev))
        return self.tree


class StaticKV:
    """Preallocated keys/values for `model`, fixed-size forwards, CUDA graphs on CUDA (see the module docstring).

    graphs None = capture on CUDA only; True on a CPU model raises. max_len is rounded up to a multiple of 64
    (aligned masks for the fused attention kernels).
    """

    def __init__(self, model: nn.Module, max_len: int, capture: Sequence[int] | None = None,
                 graphs: bool | None = None):
        p = next(model.parameters())
        self.model, self.capture = model, capture
        self._capture = None if capture is None else FeatureCapture(model, capture)  # as DynamicKV's
        self.device, self.dtype = p.device, p.dtype
        if graphs and self.device.type != "cuda":
            raise ValueError(f"StaticKV: CUDA graphs need a CUDA model (this one is on {self.device})")
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.graph_error: str | None = None  # why capture failed, if it did (then graphs is False)
        self.key = cache_kwarg(model)
        self.window = sliding_window(model)
        self.length = 0
        self._pending = 0
        self._steps: dict[tuple[int, bool], _Step] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.slots = torch.arange(1, device=self.device)
        self._allocate(max_len)

    def _allocate(self, max_len: int) -> None:
        """(Re)build every layer with max_len slots, keeping the committed rows; drops captured graphs."""
        cfg = text_config(self.model.config)
        self.max_len = -(-max_len // 64) * 64
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
        old = getattr(self, "cache", None)
        self.cache = Cache(layers=[_SlotLayer(self.max_len, self) for _ in range(int(cfg.num_hidden_layers))])
        probe = torch.zeros(1, kv_heads, 1, head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.cache.layers):
            layer.lazy_initialization(probe, probe)
            if old is not None:
                layer.keys[:, :, :self.length] = old.layers[i].keys[:, :, :self.length]
                layer.values[:, :, :self.length] = old.layers[i].values[:, :, :self.length]
        self._steps.clear()

    def _step(self, q: int, last_only: bool) -> _Step:
        key = (q, last_only)
        if key not in self._steps:
            self._steps[key] = _Step(q, self.max_len, self.window, self.dtype, self.device)
        return self._steps[key]

    def _stage(self, step: _Step, ids: torch.Tensor, parents: torch.Tensor | None) -> None:
        """Write this forward's ids, positions, slots and mask into the step's buffers (no host sync)."""
        q, base = step.q, self.length
        if step.copied is not None and not step.copied.query():
            step.copied.synchronize()  # wait until the last copies out of the staging buffers are done (rare)
        if ids.device.type == "cpu":
            step.h_ids.copy_(ids.reshape(-1))
            step.ids[0].copy_(step.h_ids, non_blocking=True)
        else:
            step.ids[0].copy_(ids.reshape(-1))
        if parents is None or is_chain(parents):
            torch.arange(base, base + q, out=step.pos[0])
            anc = step.causal
        else:
            a, depths = tree_layout(parents)
            h_anc, h_depth, anc = step.tree_buffers()
            h_anc.copy_(a)
            h_depth[1:].copy_(depths)
            anc.copy_(h_anc, non_blocking=True)
            step.pos[0].copy_(h_depth, non_blocking=True)
            step.pos.add_(base)
        if step.copied is not None:
            step.copied.record()
        torch.arange(base, base + q, out=step.slots)
        tree_mask(base, anc, step.pos[0], self.dtype, self.max_len, self.window, out=step.mask)

    def _forward(self, step: _Step, last_only: bool) -> tuple[torch.Tensor, Features | None]:
        self.slots = step.slots
        kw = {self.key: self.cache, "use_cache": True, "logits_to_keep": 1 if last_only else 0,
              "attention_mask": step.mask, "position_ids": step.pos}
        if self._capture is None:
            return self.model(input_ids=step.ids, **kw).logits, None
        with self._capture as cap:
            out = self.model(input_ids=step.ids, **kw)
        return out.logits, cap.features()

    def _replay(self, step: _Step, last_only: bool) -> tuple[torch.Tensor, Features | None]:
        """Run the step's graph, capturing it first (two warm-up runs on a side stream, as CUDA graphs need).

        Warm-up runs write only the slots this forward writes anyway, so the committed rows are safe.
        """
        if step.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(step, last_only)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    step.out = self._forward(step, last_only)
            except RuntimeError as e:  # a model whose forward cannot be captured still decodes, eagerly
                self.graphs, self.graph_error = False, f"{type(e).__name__}: {e}"
                warnings.warn(f"StaticKV: CUDA graph capture failed, running eagerly ({self.graph_error})",
                              stacklevel=3)
                return self._forward(step, last_only)
            step.graph = graph
        self.slots = step.slots
        step.graph.replay()
        assert step.out is not None
        return step.out

    @torch.no_grad()
    def run(self, ids: torch.Tensor, parents: torch.Tensor | None = None, logits_to_keep: int = 0,
            pad: torch.Tensor | None = None) -> tuple[torch.Tensor, Features | None]:
        if pad is not None:
            raise ValueError("StaticKV decodes one unpadded row; batches use DynamicKV")
        if logits_to_keep not in (0, 1):
            raise ValueError(f"StaticKV.run: logits_to_keep must be 0 (all rows) or 1 (the last), got {logits_to_keep}")
        q = int(ids.shape[-1])
        if self.length + q > self.max_len:
            self._allocate(2 * (self.length + q))
        last_only = logits_to_keep == 1
        step = self._step(q, last_only)
        self._stage(step, ids, parents)
        self._pending = q
        # Graphs for verify-sized forwards only: a prefill (empty cache) runs once and is not worth a capture.
        if self.graphs and q <= GRAPH_MAX_ROWS and self.length > 0:
            return self._replay(step, last_only)
        out = self._forward(step, last_only)
        if self.length == 0 and step.graph is None:
            del self._steps[(q, last_only)]  # prompt-sized buffers are not kept
        return out

    def keep(self, rows: Sequence[int]) -> None:
        _gather(self.cache.layers, self.length, rows)
        self.length += len(rows)
        self._pending = 0

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


def new_kv(model: nn.Module, kind: str | KVCache, capture: Sequence[int] | None = None, room: int = 256,
           graphs: bool | None = None) -> KVCache:
    """A fresh cache of `kind` ("dynamic" or "static"; room = expected rows, graphs as in StaticKV).

    A cache object instead of a name is emptied and reused: a static cache keeps its captured graphs across
    generations (benchmarks), so it must have been built for the same model and capture layers.
    """
    if not isinstance(kind, str):
        if getattr(kind, "model", model) is not model or getattr(kind, "capture", capture) != capture:
            raise ValueError("new_kv: a reused cache must belong to the same model and capture layers")
        kind.truncate(0)
        return kind
    if kind == "dynamic":
        return DynamicKV(model, capture)
    if kind == "static":
        return StaticKV(model, room, capture, graphs)
    raise ValueError(f"cache must be one of {', '.join(CACHE_KINDS)}, got {kind!r}")


def timed_pass(kv: KVCache, ids: torch.Tensor, sync: Callable[[], None] = lambda: None) -> float:
    """Seconds of one target forward over `ids` on the cache, which then drops the pass again (eval.costs
    and data.packed time their passes with it; `sync` waits for a GPU)."""
    sync()
    t = time.perf_counter()
    kv.run(ids)
    sync()
    dt = time.perf_counter() - t
    kv.keep([])
    return dt
