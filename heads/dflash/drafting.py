"""The DFlash drafter (the decoder's adapter, heads.types.Drafter): one block pass proposes B - 1 tokens.

    d = drafter(head, target, generator=None)
    make = drafter_factory(head, target, tree="auto", k=4)   # eval.tree: auto / chain

State between calls: each layer's keys/values of the committed context (positions 0..n-1, from the target's
features only) and the anchor, the newest token at position n that the target has not processed. `draft(k)` runs
the block [anchor, mask x (B-1)] at positions n..n+B-1 once over the whole context, and returns the chain of its
first min(k, m) drafting slots (m = B - 1; B with sample_from_anchor). The block is always run whole, so slot
i's base logits depend only on the committed prefix (never on k); with a Markov head, the drafted tokens are
then drawn left to right, each slot's q its base logits plus the bias of the token drawn before it (the anchor
for the first), as vLLM's DSpark speculator does. Either way each drafted token is drawn from a q that depends
only on the prefix and the chain before it (argmax at temperature 0), which is what exact chain verification
needs. Nothing drafted is ever kept: `commit` / `commit_tokens` append the target's features of the accepted
positions to the context, whatever path (head or n-gram) was accepted.

Tests: `.venv/bin/python -m pytest -q tests/test_dflash.py tests/test_sampling_drafters.py -k "dflash or dspark"`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from heads.base import check_eval_tree
from heads.dflash.model import DFlashHead
from heads.types import DraftTree, Features, TargetIO


class DFlashDrafter:
    """The decoder's adapter for a DFlash head (see the module docstring)."""

    def __init__(self, head: DFlashHead, target: TargetIO, generator: torch.Generator | None = None):
        self.head, self.target = head.eval(), target
        self.capture_layers: tuple[int, ...] | None = tuple(head.layer_ids)
        self.generator = generator
        self.device = next(head.parameters()).device
        self.ctx: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.n = 0
        self.anchor: int | None = None

    def _extend(self, features: Features | None, m: int) -> None:
        """Append the context keys/values of m new positions (n..n+m-1) from the target's features."""
        if features is None or features.aux is None or features.aux.shape[1] != m:
            got = None if features is None or features.aux is None else features.aux.shape[1]
            raise ValueError(f"DFlash drafter: expected aux features for {m} positions, got {got}")
        pos = torch.arange(self.n, self.n + m, device=self.device)[None]
        new = self.head.context_kv(features.aux.to(self.device), pos, self.target)
        self.ctx = new if not self.ctx else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                             for (k0, v0), (k1, v1) in zip(self.ctx, new)]
        self.n += m

    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self.ctx, self.n = [], 0
        self._extend(features, prompt_ids.numel())
        self.anchor = int(next_token)

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens(list(accepted), features, next_token)

    @torch.no_grad()
    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        # Only the target's features enter the context: the accepted tokens themselves are not needed.
        self._extend(features, len(tokens) + 1)
        self.anchor = int(next_token)

    @torch.no_grad()
    def block_states(self) -> torch.Tensor:
        """The drafting slots' final states [drafting slots, H] of the block anchored at the current anchor."""
        if self.anchor is None:
            raise RuntimeError("DFlash drafter: draft() before begin()")
        head, bs = self.head, self.head.block_size
        emb = head.block_embeddings(torch.tensor([self.anchor], device=self.device), self.target)
        pos = torch.arange(self.n, self.n + bs, device=self.device)[None]
        h = head.block_states(emb, pos, self.ctx, None, self.target)  # no mask: all context, the whole block
        return h[0, head.first_slot:]

    @torch.no_grad()
    def block_logits(self, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocab logits [drafting slots, DV] of the current block; prev [drafting slots]: the target ids
        before each drafted token, needed (only) with a Markov head."""
        return self.head.logits(self.block_states(), prev).float()

    @torch.no_grad()
    def draft(self, k: int, temperature: float) -> DraftTree:
        head = self.head
        m = min(k, head.block_size - head.first_slot)
        if m <= 0:
            return DraftTree.chain(torch.empty(0, dtype=torch.long, device=self.device))
        h = self.block_states()[:m]
        if head.markov_head is None:
            return self._draw(head.logits(h).float(), temperature)
        # DSpark's sequential stage: the block's base logits once, then slot i's bias is that of the token drawn
        # before it (head.logits, one slot at a time)
        base = head.base_logits(h)
        ids, probs, prev = [], [], torch.tensor([self.anchor], device=self.device)
        for i in range(m):
            tree = self._draw(head.add_markov_bias(base[i : i + 1], prev).float(), temperature)
            ids.append(tree.tokens)
            probs.append(tree.probs)
            prev = tree.tokens
        return DraftTree.chain(torch.cat(ids), None if temperature <= 0 else torch.cat(probs))

    def _draw(self, logits: torch.Tensor, temperature: float) -> DraftTree:
        """The chain of one draw per row of draft-vocab logits [m, DV] (argmax at temperature 0)."""
        if temperature <= 0:
            return DraftTree.chain(self.head.to_target_ids(logits.argmax(-1)))
        q = torch.softmax(logits / temperature, dim=-1)
        draws = torch.multinomial(q.cpu(), 1, generator=self.generator).reshape(-1).to(self.device)
        return DraftTree.chain(self.head.to_target_ids(draws), self.head.to_target_probs(q, self.target.vocab_size))


def drafter(head: nn.Module, target: TargetIO, **kw: Any) -> DFlashDrafter:
    """The decoder adapter (generator: the drafter's own sampling generator)."""
    if not isinstance(head, DFlashHead):
        raise TypeError(f"heads.dflash.drafter: not a DFlash head: {type(head).__name__}")
    return DFlashDrafter(head, target, **kw)


def drafter_factory(head: nn.Module, target: TargetIO, tree: str = "auto", k: int = 4) -> Callable[[], DFlashDrafter]:
    """Fresh drafters for eval.tree: auto or chain (a block is a chain); `k` is unused (the length comes with
    each draft call, at most block_size - 1). Any other tree raises HeadError naming the family."""
    check_eval_tree(tree, head.family, ("chain",))
    return lambda: drafter(head, target)
