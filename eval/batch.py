"""Batch-size sweep: decode tokens/s of the whole machine with and without speculation, batched verification.

Design (greedy, exact). All B rows share one KV cache (left padded, one attention mask). Each round:
  1. every row's drafter proposes up to k tokens after the row's root (the last emitted token, which the
     target has not seen yet); shorter drafts are padded with a filler token up to the longest one;
  2. one target pass runs over [root, d_1 .. d_k] for all rows: argmax g_0 .. g_k, where g_i is the
     target's greedy token after root, d_1 .. d_i;
  3. row r accepts a_r = the number of leading i with d_(i+1) == g_i (fillers never count);
  4. the batch advances by m = min_r a_r plus one token: every row emits g_0 .. g_m. For a row with
     a_r > m, g_m equals its accepted draft d_(m+1); for a row with a_r == m it is the row's correction.
     Either way g_0 .. g_m is exactly what plain greedy decoding emits, so truncating an exact acceptance
     keeps it exact, and every row stays the same length (one cache, one mask);
  5. the cache keeps root, d_1 .. d_m (m+1 entries per row) and drops the rest; g_m is the new root.
Worked example, k = 3, two rows: row 0 drafts [a b c] with g = [a b x y] (a_0 = 2); row 1 drafts
[p q r] with g = [p z ...] (a_1 = 1). m = 1: both rows emit g_0, g_1 ([a b] and [p z]); the cache keeps
[root, d_1]; the new roots are b and z. Row 0 loses its accepted `b`-then-`x`, which it re-drafts next round.
Plain decoding is the same loop with k = 0. Rows never stop at EOS: every row decodes `max_new_tokens`
tokens so the token count is fixed (it is a throughput measurement, not a chat).

The drafter per row is any `heads.base.Drafter` that needs no target features (capture_layers None), by
default eval.drafters' n-gram prompt lookup; a head's drafter would need per-row features from the batched
pass and is not used here (the report says which drafter ran).

    python -m eval.batch --config configs/tiny-eagle.yaml --batch-sizes 1,2,4 --k 4 --max-new-tokens 32
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from data.kvcache import DynamicKV
from data.tokenize import left_pad
from heads.base import Drafter


@dataclass
class BatchResult:
    """One batched generation: tokens [B, max_new_tokens], target passes, decode seconds (prefill excluded)."""

    tokens: torch.Tensor
    passes: int
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.numel() / self.decode_s if self.decode_s > 0 else float("inf")

    @property
    def tau(self) -> float:
        """Tokens per row per target pass, counting the corrected/bonus token (prefill's token excluded)."""
        return (self.tokens.shape[1] - 1) / max(self.passes, 1)


def _chain_tokens(drafter: Drafter, k: int) -> list[int]:
    tree = drafter.draft(k, 0.0)
    n = len(tree)
    if n > k:
        raise ValueError(f"drafter returned {n} tokens for k={k}")
    if n and not torch.equal(tree.parents.cpu(), torch.arange(-1, n - 1)):
        raise ValueError("the batch sweep verifies chains only; the drafter returned a tree")
    return [int(t) for t in tree.tokens.tolist()]


@torch.no_grad()
def batched_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    k: int = 0,
    make_drafter: Callable[[], Drafter] | None = None,
) -> BatchResult:
    """Greedy-decode every prompt row for `max_new_tokens` tokens; speculative when k > 0 (see module doc)."""
    if k > 0 and make_drafter is None:
        raise ValueError("k > 0 needs a drafter factory")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    # One cache for all rows, left padded: it keeps the rows' mask and counts positions of real tokens only.
    kv = DynamicKV(model)
    logits = kv.run(ids, pad=mask)[0]
    kv.keep(range(ids.shape[1]))
    root = logits[:, -1].argmax(-1)  # [B]: the first new token of every row (from prefill, not timed)
    emitted = [root[:, None]]
    n_out = 1
    drafters: list[Drafter] = []
    if k > 0:
        for i, row in enumerate(prompts):
            d = make_drafter()
            if d.capture_layers is not None:
                raise ValueError("the batch sweep runs drafters that need no target features")
            d.begin(torch.tensor(list(row), dtype=torch.long), None, int(root[i]))
            drafters.append(d)
    passes = 0
    t0 = time.perf_counter()
    while n_out < max_new_tokens:
        drafts = [_chain_tokens(d, k) for d in drafters] if k > 0 else []
        width = max((len(d) for d in drafts), default=0)
        # Fillers: pad shorter drafts with the row's root; they are excluded from acceptance below.
        block = [[int(root[i])] + d + [int(root[i])] * (width - len(d)) for i, d in enumerate(drafts)]
        x = torch.tensor(block, dtype=torch.long, device=device) if width else root[:, None]
        g = kv.run(x)[0].argmax(-1)  # [B, width+1]; g[:, i] follows x[:, :i+1]
        passes += 1
        m = width
        for i, d in enumerate(drafts):
            a = 0
            while a < len(d) and d[a] == int(g[i, a]):
                a += 1
            m = min(m, a)
        kv.keep(range(m + 1))  # root and the m drafts every row accepted
        emitted.append(g[:, : m + 1])
        n_out += m + 1
        root = g[:, m]
        for i, d in enumerate(drafters):
            d.commit(list(range(m)), None, int(root[i]))
    decode_s = time.perf_counter() - t0
    tokens = torch.cat(emitted, dim=1)[:, :max_new_tokens].cpu()
    return BatchResult(tokens, passes, decode_s)


def sweep(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    pad_id: int,
    batch_sizes: Sequence[int],
    k: int,
    make_drafter: Callable[[], Drafter],
    max_new_tokens: int = 32,
    drafter_name: str = "ngram",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """tokens/s at each batch size, plain and speculative, run back to back (plain first) per batch size.

    Rows are the prompts cycled to fill the batch. Returns the report's `batch_sweep` section:
    {"drafter", "k", "max_new_tokens", "greedy", "rows": [{batch_size, plain_tok_s, spec_tok_s, speedup,
    tau, identical}], "crossover_batch_size"}; the crossover is the first batch size whose speculative
    throughput is not above plain (None when speculation pays over the whole range).
    """
    if not prompts:
        raise ValueError("batch sweep needs at least one prompt")
    # One untimed small run so first-call allocation and kernel selection hit neither side.
    batched_generate(model, [prompts[0]], 2, pad_id)
    rows = []
    for b in batch_sizes:
        if b < 1:
            raise ValueError(f"batch size must be >= 1, got {b}")
        batch = [prompts[i % len(prompts)] for i in range(b)]
        plain = batched_generate(model, batch, max_new_tokens, pad_id)
        spec = batched_generate(model, batch, max_new_tokens, pad_id, k=k, make_drafter=make_drafter)
        row = {
            "batch_size": b,
            "plain_tok_s": plain.tokens_per_s,
            "spec_tok_s": spec.tokens_per_s,
            "speedup": spec.tokens_per_s / plain.tokens_per_s,
            "tau": spec.tau,
            "identical": bool(torch.equal(plain.tokens, spec.tokens)),
        }
        rows.append(row)
        if progress is not None:
            progress(f"batch {b}: plain {row['plain_tok_s']:.1f} tok/s, speculative {row['spec_tok_s']:.1f} tok/s "
                     f"({row['speedup']:.2f}x, tau {row['tau']:.2f})")
    crossover = next((r["batch_size"] for r in rows if r["speedup"] <= 1.0), None)
    return {
        "drafter": drafter_name,
        "k": k,
        "max_new_tokens": max_new_tokens,
        "greedy": True,
        "tokens_per_s": "decode only (prefill excluded), all rows together",
        "rows": rows,
        "crossover_batch_size": crossover,
    }
