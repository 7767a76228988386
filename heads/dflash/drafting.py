"""The DFlash drafter (the decoder's adapter, heads.types.Drafter): one block pass proposes B - 1 tokens.

    d = drafter(head, target, generator=None)
    d = drafter(head, target, tree=[[0], [1], [0, 0]])      # a static top-k tree over the block's slots
    d = drafter(head, target, tree="dynamic", top_k=3, total_tokens=3)   # EAGLE-2's tree over them
    make = drafter_factory(head, target, tree="auto", k=4)   # eval.tree: auto / chain / static / dynamic

State between calls: each layer's keys/values of the committed context (positions 0..n-1, from the target's
features only) and the anchor, the newest token at position n that the target has not processed. `draft(k)` runs
the block [anchor, mask x (B-1)] at positions n..n+B-1 once over the whole context, and returns the chain of its
first min(k, m) drafting slots (m = B - 1; B with sample_from_anchor). The block is always run whole, so slot
i's state depends only on the committed prefix (never on k); with a Markov head or head.prev_mlp, the drafted
tokens are then drawn left to right, each slot's q its logits given the token drawn before it (the anchor for
the first), as vLLM's DSpark speculator does. Either way each drafted token is drawn from a q that depends
only on the prefix and the chain before it (argmax at temperature 0), which is what exact chain verification
needs.

A tree (eval.tree static, or `tree` choices as Medusa's, heads.tree; cut to the drafting slots): the same one block
pass, then per depth d the top-ranked candidates of slot d's logits given each parent's token (the anchor for
depth 1): one logits call per depth for all of that depth's parents, since a sequential head's slot reads the
token before it (a Markov head alone: one LM head product and a bias per parent); a head that is not reads
none, so every parent's candidates are the slot's own, computed once. eval.tree dynamic (`tree="dynamic"`,
top_k, total_tokens: eval.tree_topk, tree_tokens) shapes the tree by the head's confidence instead, as EAGLE-2
does (heads.tree.grow_dynamic): per depth the top_k best nodes by cumulative draft log-prob each propose their
top_k best children of the next slot's logits given their token, and the total_tokens best nodes of all depths
are verified; `auto` may become one where the verify curve pays for it (eval.calibrate.choose_tree). Siblings
are distinct deterministic candidates (DraftTree sampling "topk"): verification's sibling rule keeps either tree
exact, at every temperature, and nothing is drawn. Every node's candidates depend only on the committed prefix
and its path. Nothing drafted is ever kept: `commit` / `commit_tokens` append the target's features of the accepted
positions to the context, whatever path (head or n-gram) was accepted.

Several requests at once (the batched decoder's rows, eval.batch): `DFlashDrafter.draft_together(drafters, ks,
temperature)` runs their blocks in ONE pass (each request's context keys padded to the longest and masked, its
block at its own positions), and each drafter's next `draft` returns its chain, drawn as its own draft would
(its own generator, slot by slot with a Markov head, the bias of every request's slot in one call), or its tree. A
drafter with `hold` set keeps its commits' features until its next draft or `DFlashDrafter.settle_together(drafters)`,
which projects the held positions of several requests into context keys in one pass (the projection is
position-wise, so the keys are the ones each request's own commit makes).

Tests: `.venv/bin/python -m pytest -q tests/test_dflash.py tests/test_sampling_drafters.py -k "dflash or dspark"`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from heads.base import check_eval_tree
from heads.cache import pad_requests
from heads.dflash.model import DFlashHead
from heads.tree import DEFAULT_CHOICES, CandidatePool, StaticTree, dynamic_nodes, grow_dynamic
from heads.types import DraftTree, Features, TargetIO

TREES = ("chain", "static", "dynamic")  # the eval.tree values drafter_factory maps besides "auto" (a chain)


class DFlashDrafter:
    """The decoder's adapter for a DFlash head (see the module docstring)."""

    def __init__(self, head: DFlashHead, target: TargetIO, generator: torch.Generator | None = None,
                 tree: list[list[int]] | str | None = None, top_k: int = 10, total_tokens: int = 60):
        self.head, self.target = head.eval(), target
        self.capture_layers: tuple[int, ...] | None = tuple(head.layer_ids)
        self.max_depth = head.block_size - head.first_slot  # the drafting slots: no draft is deeper
        if isinstance(tree, str) and tree not in ("chain", "dynamic"):
            raise ValueError(f"DFlash drafter: tree '{tree}' is not chain, dynamic or a list of choices")
        if top_k < 1 or total_tokens < 1:
            raise ValueError(f"DFlash drafter: top_k ({top_k}) and total_tokens ({total_tokens}) must be >= 1")
        # None for chains and dynamic trees; the shape of a static one
        self.tree = None if tree is None or isinstance(tree, str) else StaticTree(tree)
        if self.tree is not None and self.tree.depth > self.max_depth:
            raise ValueError(f"DFlash tree has depth {self.tree.depth} but the block has {self.max_depth} drafting slots")
        # a dynamic tree's (children per expanded node: at most the draft vocab, nodes verified); None otherwise
        self.sizes = (min(top_k, head.d2t.numel()), total_tokens) if tree == "dynamic" else None
        self.generator = generator
        self.device = next(head.parameters()).device
        self.ctx: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.n = 0
        self.last: torch.Tensor | None = None  # the context feature at position n - 1 [1, H] (head.anchor_feature)
        self.anchor: int | None = None
        self.ready: tuple[int, float, DraftTree] | None = None  # (drafted length, temperature, chain): draft_together
        # hold: commits' features wait (held, in order) until the next draft or settle_together, which projects
        # the held positions of several requests in one pass (the batched decoder sets it: eval.batch)
        self.hold = False
        self.held: list[torch.Tensor] = []

    @property
    def chains(self) -> bool:
        """Whether this drafter drafts chains (neither a static nor a dynamic tree)."""
        return self.tree is None and self.sizes is None

    @staticmethod
    def _aux(features: Features | None, m: int) -> torch.Tensor:
        """The captured layers [1, m, n*H] of m new positions, checked."""
        if features is None or features.aux is None or features.aux.shape[1] != m:
            got = None if features is None or features.aux is None else features.aux.shape[1]
            raise ValueError(f"DFlash drafter: expected aux features for {m} positions, got {got}")
        return features.aux

    def _append(self, new: list[tuple[torch.Tensor, torch.Tensor]], last: torch.Tensor) -> None:
        """Append each layer's keys/values of new positions to the context; last: the newest one's feature."""
        self.ctx = new if not self.ctx else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                             for (k0, v0), (k1, v1) in zip(self.ctx, new)]
        self.n += new[0][0].shape[2]
        self.last = last

    def _extend(self, aux: torch.Tensor) -> None:
        """Append the context keys/values of the new positions n.. of these captured layers."""
        pos = torch.arange(self.n, self.n + aux.shape[1], device=self.device)[None]
        c = self.head.context(aux.to(self.device))
        self._append(self.head.context_kv(c, pos, self.target), c[:, -1])

    def _settle(self) -> None:
        """Project the held commits' positions, if any."""
        if self.held:
            held, self.held = self.held, []
            self._extend(torch.cat(held, dim=1) if len(held) > 1 else held[0])

    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self.ctx, self.n, self.ready, self.held, self.last = [], 0, None, [], None
        self._extend(self._aux(features, prompt_ids.numel()))
        self.anchor = int(next_token)

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens(list(accepted), features, next_token)

    @torch.no_grad()
    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        # Only the target's features enter the context: the accepted tokens themselves are not needed. Held
        # features are kept as given: the batched decoder's are never written again (data.kvcache.DynamicKV
        # allocates every forward), and DeferredSync copies what it defers.
        aux = self._aux(features, len(tokens) + 1)
        self.anchor, self.ready = int(next_token), None
        if self.hold:
            self.held.append(aux)
        else:
            self._extend(aux)

    @torch.no_grad()
    def block_states(self) -> torch.Tensor:
        """The drafting slots' final states [drafting slots, H] of the block anchored at the current anchor."""
        if self.anchor is None:
            raise RuntimeError("DFlash drafter: draft() before begin()")
        self._settle()
        head, bs = self.head, self.head.block_size
        emb = head.block_embeddings(torch.tensor([self.anchor], device=self.device), self.target, self.last)
        pos = torch.arange(self.n, self.n + bs, device=self.device)[None]
        h = head.block_states(emb, pos, self.ctx, None, self.target)  # no mask: all context, the whole block
        return h[0, head.first_slot:]

    @torch.no_grad()
    def block_logits(self, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocab logits [drafting slots, DV] of the current block; prev [drafting slots]: the target ids
        before each drafted token, needed (only) by a sequential head (a Markov head, head.prev_mlp)."""
        head = self.head
        return head.slot_logits(self.block_states(), prev, self.target,
                                list(range(head.first_slot, head.block_size))).float()

    def nodes(self, k: int) -> int:
        """How many nodes draft(k) returns (heads.types.Drafter; eval.policy prices a pass by it)."""
        m = min(k, self.max_depth)
        if self.sizes is not None:
            return dynamic_nodes(self.sizes[0], m, self.sizes[1])
        return max(m, 0) if self.tree is None or m <= 0 else len(self.tree.truncate(m))

    @torch.no_grad()
    def draft(self, k: int, temperature: float) -> DraftTree:
        m = min(k, self.max_depth)
        ready, self.ready = self.ready, None
        if ready is not None and ready[:2] == (m, temperature):
            return ready[2]
        if m <= 0:
            return DraftTree.chain(torch.empty(0, dtype=torch.long, device=self.device))
        if self.chains:
            return DFlashDrafter._chains([self], self.block_states()[None, :m], [m], temperature)[0]
        return self._tree_from(self.block_states()[:m], m, temperature)

    def _tree_from(self, h: torch.Tensor, m: int, temperature: float) -> DraftTree:
        """This drafter's tree (static or dynamic) of depth <= m over the drafting slots' states h [>= m, H]."""
        return self._grow(h, m, temperature) if self.tree is not None else self._grow_dynamic(h, m, temperature)

    def _slot_logits(self, h: torch.Tensor, depth: int, prevs: list[int]) -> torch.Tensor:
        """Float32 draft-vocab logits [len(prevs), DV] of the drafting slot at tree depth `depth` (state h[depth - 1])
        given each parent's token prevs (target ids; the anchor for depth 1). The LM head runs once where the slot
        reads no previous token (a head that is not sequential, a plain slot) or only its Markov bias does."""
        head, n = self.head, len(prevs)
        slot, state = head.first_slot + depth - 1, h[depth - 1]
        if not head.sequential or head.plain(slot):
            return head.base_logits(state[None]).float().expand(n, -1)
        prev = torch.tensor(prevs, device=self.device)
        if head.prev_mlp is None:
            return head.add_markov_bias(head.base_logits(state[None]).expand(n, -1), prev).float()
        return head.slot_logits(state.expand(n, 1, -1), prev[:, None], self.target, [slot])[:, 0].float()

    def _grow_dynamic(self, h: torch.Tensor, m: int, temperature: float) -> DraftTree:
        """EAGLE-2's tree (self.sizes) of depth <= m over the drafting slots' states h [>= m, H]: a node's children
        are the best of the next slot's logits given its token (see the module docstring)."""
        assert self.sizes is not None and self.anchor is not None
        head = self.head

        def expand(pool: CandidatePool, grown: list[int]) -> torch.Tensor:  # nodes of one depth; their children's logits
            ids = torch.tensor([pool.nodes[i].token for i in grown], device=self.device)
            return self._slot_logits(h, pool.nodes[grown[0]].depth + 1, head.to_target_ids(ids).tolist())

        return grow_dynamic(self._slot_logits(h, 1, [self.anchor])[0], expand, m, *self.sizes, temperature,
                            head.to_target_ids, lambda q: head.to_target_probs(q, self.target.vocab_size))

    def _grow(self, h: torch.Tensor, m: int, temperature: float) -> DraftTree:
        """The tree (self.tree cut to depth m) over the drafting slots' states h [>= depth, H]: per depth, the
        ranked candidates of each parent's slot logits given the parent's token (see the module docstring)."""
        head, shape = self.head, self.tree.truncate(m)
        paths, parents = shape.paths, shape.parents.tolist()
        tokens: list[int] = [0] * len(paths)
        probs: list[torch.Tensor | None] = [None] * len(paths)
        for d in range(shape.depth):
            level = [i for i, p in enumerate(paths) if len(p) == d + 1]
            owners = sorted({parents[i] for i in level})  # -1: the root (the anchor)
            logits = self._slot_logits(h, d + 1, [self.anchor if o < 0 else tokens[o] for o in owners])
            ranked = head.to_target_ids(logits.topk(shape.topk, dim=-1).indices)  # temperature keeps the ranking
            q = (None if temperature <= 0
                 else head.to_target_probs(torch.softmax(logits / temperature, dim=-1), self.target.vocab_size))
            row = {o: r for r, o in enumerate(owners)}
            for i in level:
                r = row[parents[i]]
                tokens[i] = int(ranked[r, paths[i][-1]])
                probs[i] = None if q is None else q[r]
        return DraftTree(tokens=torch.tensor(tokens, device=self.device), parents=shape.parents.to(self.device),
                         probs=None if temperature <= 0 else torch.stack(probs), sampling="topk")

    @staticmethod
    def _chains(drafters: list[DFlashDrafter], h: torch.Tensor, ms: list[int],
                temperature: float) -> list[DraftTree]:
        """Each request's chain of its first ms[r] slots from the blocks' drafting states h [requests, slots, H]:
        for a head that is not sequential one draw per slot at once; for one (a Markov head, head.prev_mlp),
        DSpark's sequential stage, slot by slot left to right, each slot's logits those of the token its request
        drew before it (the anchor for the first), every request's slot in one call. A request's draws are the
        ones its own draft makes."""
        head, target = drafters[0].head, drafters[0].target
        # the LM head of every slot in one product, unless a slot's state depends on the token drawn before it
        base = head.base_logits(h) if head.prev_mlp is None else None
        if not head.sequential:
            return [d._draw(base[r, :m].float(), temperature) for r, (d, m) in enumerate(zip(drafters, ms))]
        ids: list[list[torch.Tensor]] = [[] for _ in drafters]
        probs: list[list[torch.Tensor]] = [[] for _ in drafters]
        prev = torch.tensor([d.anchor for d in drafters], device=drafters[0].device)
        for i in range(max(ms)):
            # [requests, DV]: the slot's precomputed LM head plus its Markov bias, or with prev_mlp logits() whole;
            # a plain slot (head.plain_first_slot) its LM head alone, the sequential stage not run at all
            if head.plain(head.first_slot + i):
                logits = (base[:, i] if base is not None else head.base_logits(h[:, i])).float()
            else:
                logits = (head.add_markov_bias(base[:, i], prev) if base is not None
                          else head.logits(h[:, i], prev, target)).float()
            for r, (d, m) in enumerate(zip(drafters, ms)):
                if i < m:  # past its length a request draws no more (its generator: as many draws as its own draft)
                    tree = d._draw(logits[r : r + 1], temperature)
                    ids[r].append(tree.tokens)
                    probs[r].append(tree.probs)
                    prev[r] = tree.tokens[0]
        return [DraftTree.chain(torch.cat(t), None if temperature <= 0 else torch.cat(p)) for t, p in zip(ids, probs)]

    @staticmethod
    @torch.no_grad()
    def draft_together(drafters: list[DFlashDrafter], ks: list[int], temperature: float) -> None:
        """Draft the chains of several requests at once (the batched decoder's rows: eval.batch): one block pass
        per head for all of them, each block at its own positions over its own context (the contexts padded to
        the longest and masked); drafter i's next draft(ks[i], temperature) returns its chain (or tree), the one its
        own draft would make. Held commits are settled first, together (settle_together)."""
        DFlashDrafter.settle_together([d for d, k in zip(drafters, ks) if k > 0])
        by_head: dict[tuple[int, bool], list[tuple[DFlashDrafter, int]]] = {}  # one head, chains or trees
        for d, k in zip(drafters, ks):
            m = min(k, d.max_depth)
            if m > 0 and d.anchor is not None:
                by_head.setdefault((id(d.head), d.chains), []).append((d, m))
        for rows in by_head.values():
            if len(rows) > 1:
                DFlashDrafter._draft_rows([d for d, _ in rows], [m for _, m in rows], temperature)

    @staticmethod
    def _draft_rows(drafters: list[DFlashDrafter], ms: list[int], temperature: float) -> None:
        """draft_together for requests of one head."""
        first = drafters[0]
        head, dev, bs = first.head, first.device, first.head.block_size
        # each layer's context keys/values padded to the longest; which are a request's own: alike in every layer
        padded = [pad_requests([d.ctx[layer] for d in drafters]) for layer in range(len(head.layers))]
        ctx, seen = [(keys, vals) for keys, vals, _ in padded], padded[0][2]
        n = torch.tensor([d.n for d in drafters], device=dev)
        last = torch.cat([d.last for d in drafters]) if head.anchor_proj is not None else None
        emb = head.block_embeddings(torch.tensor([d.anchor for d in drafters], device=dev), first.target, last)
        pos = n[:, None] + torch.arange(bs, device=dev)
        h = head.block_states(emb, pos, ctx, seen[:, None, None, :].expand(-1, 1, bs, -1), first.target)
        states = h[:, head.first_slot : head.first_slot + max(ms)]
        trees = (DFlashDrafter._chains(drafters, states, ms, temperature) if first.chains
                 else [d._tree_from(states[r], m, temperature) for r, (d, m) in enumerate(zip(drafters, ms))])
        for d, m, tree in zip(drafters, ms, trees):
            d.ready = (m, temperature, tree)

    @staticmethod
    @torch.no_grad()
    def settle_together(drafters: list[DFlashDrafter]) -> None:
        """Project the held commits of several requests (`hold`: the batched decoder's rows) in one pass per
        head: their positions side by side, each at its own positions; each request appends its own keys."""
        by_head: dict[int, list[DFlashDrafter]] = {}
        for d in drafters:
            if d.held:
                by_head.setdefault(id(d.head), []).append(d)
        for rows in by_head.values():
            if len(rows) == 1:
                rows[0]._settle()
                continue
            first = rows[0]
            aux = [torch.cat(d.held, dim=1) for d in rows]
            lens = [a.shape[1] for a in aux]
            pos = torch.cat([torch.arange(d.n, d.n + m) for d, m in zip(rows, lens)])[None].to(first.device)
            c = first.head.context(torch.cat(aux, dim=1).to(first.device))
            new = first.head.context_kv(c, pos, first.target)
            parts = [(k.split(lens, dim=2), v.split(lens, dim=2)) for k, v in new]  # per layer, per request
            ends = torch.tensor(lens).cumsum(0) - 1
            for r, d in enumerate(rows):
                d.held = []
                d._append([(k[r], v[r]) for k, v in parts], c[:, int(ends[r])])

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


def drafter_factory(head: nn.Module, target: TargetIO, tree: str = "auto", k: int = 4, topk: int = 10,
                    tokens: int = 60) -> Callable[[], DFlashDrafter]:
    """Fresh drafters for eval.tree: auto or chain (a block is a chain; the eval may first resolve auto to a
    dynamic tree sized by the verify curve, eval.calibrate.choose_tree), static (heads.tree's default choices cut
    to the drafting slots), dynamic (EAGLE-2's: `topk` children per expanded node, `tokens` nodes verified;
    eval.tree_topk and eval.tree_tokens); `k` is unused (the length comes with each draft call, at most the
    drafting slots). Any other tree raises HeadError naming the family."""
    check_eval_tree(tree, head.family, TREES)
    if tree == "dynamic":
        return lambda: drafter(head, target, tree="dynamic", top_k=topk, total_tokens=tokens)
    if tree != "static":
        return lambda: drafter(head, target)
    slots = head.block_size - head.first_slot
    choices = [list(p) for p in StaticTree(DEFAULT_CHOICES).truncate(slots).paths]
    return lambda: drafter(head, target, tree=choices)
