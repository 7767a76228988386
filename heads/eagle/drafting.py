"""The EAGLE drafter (the decoder's adapter, heads.types.Drafter): chains, or EAGLE-2 dynamic trees.

    d = drafter(head, target, tree="chain" | "dynamic", top_k=10, total_tokens=60, depth=None, generator=None)
    make = drafter_factory(head, target, tree="auto", k=4)   # eval.tree (and tree_topk, tree_tokens) mapped
    d.nodes(3)                                               # the nodes draft(3) returns (eval.policy prices it)

The head's own KV cache (transformers' DynamicCache, see heads.cache) holds the committed rows; draft rows are
appended while drafting and cropped away at the end of `draft`, and `commit` recomputes the accepted rows from
the target's real features (the rollback). The EAGLE-2 tree grows as heads.tree's pool of `Candidate` nodes.
`EagleDrafter.draft_together(drafters, ks, temperature)` drafts the chains of several requests (the batched
decoder's rows) in one head pass per depth: each request's committed keys padded to the longest and masked, its
draft rows batched; each drafter's next `draft` returns its chain. A drafter with `hold` set keeps its commit
until its next draft or `EagleDrafter.settle_together(drafters)`, which runs the held commits of several
requests in one head pass (their paths padded to the longest, each over its own committed rows). A head.pointer
head also keeps, per request, the pointer's key of every committed position and the token that followed it; its
logits are then the log-probs over the draft vocab extended by the request's copy tokens (`_to_ids`, `_to_probs`
map them back to target ids).

Tests: `.venv/bin/python -m pytest -q tests/test_eagle.py tests/test_sampling_drafters.py -k eagle`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from heads.base import check_eval_tree
from heads.cache import crop_to, pad_requests
from heads.eagle.model import masked_attention, rotary
from heads.sampling import draft_token
from heads.tree import CandidatePool, dynamic_nodes, grow_dynamic
from heads.types import DraftTree, Features, TargetIO

TREES = ("chain", "dynamic")  # the eval.tree values drafter_factory maps besides "auto"


class EagleDrafter:
    """The decoder's adapter (heads.types.Drafter) for an EAGLE-1 or EAGLE-3 head.

    State: the head's own KV cache over committed rows (row p pairs emb(x_{p+1}) with the target features
    at p, RoPE position p) and the output o / logits of the last committed row, which drafts the root's
    children. A draft row at tree depth d sits at position n-1+d (n committed rows), reads its token and
    its parent's PRE-norm output o, and attends to the whole cache plus its ancestors' draft rows: the
    same keys training-time test uses. Draft rows are never kept: `draft` crops them off the cache and
    `commit` recomputes the accepted rows from the target's real features (the rollback).

    tree="chain": one child per depth (argmax at temperature 0, else a sample of q; probs given, "iid").
    tree="dynamic" (EAGLE-2): at each depth expand the `top_k` best nodes by cumulative draft log-prob,
    each proposing its `top_k` best children; finally keep the `total_tokens` best nodes of all depths
    (ancestor-closed because a child never scores above its parent). A node that can no longer make the
    selection (CandidatePool.cutoff) is not expanded: the same tree for less head work, which matters for the
    small trees a CPU verifies in about one pass (2-3 nodes). Children are deterministic top-k, so
    the tree is marked sampling="topk" with q at the parent when temperature > 0.
    """

    def __init__(self, head: nn.Module, target: TargetIO, tree: str = "chain", top_k: int = 10,
                 total_tokens: int = 60, depth: int | None = None, generator: torch.Generator | None = None):
        if tree not in ("chain", "dynamic"):
            raise ValueError(f"EAGLE drafter: tree '{tree}' is not one of chain, dynamic")
        if top_k < 1 or total_tokens < 1:
            raise ValueError(f"EAGLE drafter: top_k ({top_k}) and total_tokens ({total_tokens}) must be >= 1")
        self.head, self.target = head.eval(), target
        self.capture_layers: tuple[int, ...] | None = tuple(head.layer_ids)
        self.tree, self.top_k, self.total_tokens, self.depth = tree, top_k, total_tokens, depth
        self.generator = generator
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache = DynamicCache()  # layer 0: the head's layer; holds exactly the n committed rows between calls
        self.n = 0
        self.last_o: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None
        self.tree_tokens: list[int] = []
        self.ready: tuple[int, float, DraftTree] | None = None  # (k, temperature, chain) from draft_together
        # hold: commits wait (held: path, features) until the next draft or settle_together, which runs the
        # held commits of several requests in one head pass (the batched decoder sets it: eval.batch)
        self.hold = False
        self.held: tuple[list[int], Features] | None = None
        # head.pointer: the request's tokens outside the draft vocab, in first-seen order (extended-vocab index V + i),
        # and the pointer's keys of the committed positions with the extended-vocab index of the token after each
        self.pointer = bool(getattr(head, "pointer", False))
        self.copy_ids: list[int] = []
        self.ptr_keys: torch.Tensor | None = None
        self.ptr_ext: torch.Tensor | None = None

    # -- rows
    def _rows(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
        """Run new rows through the head's layer: their K/V are appended to the cache, and row i attends to
        the cache rows (the new ones included) where mask [rows, cache rows after the append] allows.
        Returns their PRE-norm outputs o [1, rows, H]."""
        emb_dev = next(self.target.embed.parameters()).device
        emb = self.target.embed(tokens[None].to(emb_dev)).to(self.device)
        cos, sin = rotary(self.target, hidden, positions[None].to(self.device))
        q, k, v, resid = self.head.rows(emb, hidden, cos, sin)
        keys, vals = self.cache.update(k, v, 0)
        return self.head.layer.finish(masked_attention(q, keys, vals, mask.to(self.device)), resid)

    def _logits(self, o: torch.Tensor) -> torch.Tensor:
        """The head's logits over its vocab: the draft vocab, then (head.pointer) this request's copy tokens."""
        if self.ptr_keys is None:
            return self.head.logits(o, self.target).float()
        v = self.head.d2t.numel()
        return self.head.logits(o, self.target, (self.ptr_keys, self.ptr_ext, v + len(self.copy_ids), None)).float()

    def _remember(self, tokens: list[int], last: torch.Tensor) -> None:
        """head.pointer: the pointer's keys of newly committed positions (target's last hidden state [1, m, H]) and
        the token after each (`tokens`, x_{p+1} for position p); tokens outside the draft vocab join the copy
        tokens (training scores the same set at the same index: heads.eagle.losses.copy_set)."""
        if not self.pointer:
            return
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        in_vocab = self.head.t2d[ids].tolist()
        draft_index = torch.searchsorted(self.head.draft_ids(), ids).tolist()
        index = {t: i for i, t in enumerate(self.copy_ids)}
        v = self.head.d2t.numel()
        ext = []
        for tok, inside, j in zip(tokens, in_vocab, draft_index):
            if not inside and tok not in index:
                index[tok] = len(self.copy_ids)
                self.copy_ids.append(tok)
            ext.append(j if inside else v + index[tok])
        ext_t = torch.tensor(ext, dtype=torch.long, device=self.device)
        keys = self.head.pointer_keys(last.to(self.device))[0]
        self.ptr_ext = ext_t if self.ptr_ext is None else torch.cat([self.ptr_ext, ext_t])
        self.ptr_keys = keys if self.ptr_keys is None else torch.cat([self.ptr_keys, keys])

    def _to_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Head-vocab ids (copy tokens after the draft vocab) -> target ids."""
        if self.ptr_keys is None:
            return self.head.to_target_ids(ids)
        v = self.head.d2t.numel()
        extra = torch.tensor(self.copy_ids + [0], dtype=torch.long, device=ids.device)
        return torch.where(ids < v, self.head.to_target_ids(ids.clamp(max=v - 1)), extra[(ids - v).clamp(min=0)])

    def _to_probs(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the head's vocab (copy tokens after the draft vocab) -> over the target's."""
        if self.ptr_keys is None:
            return self.head.to_target_probs(q, self.target.vocab_size)
        v = self.head.d2t.numel()
        out = self.head.to_target_probs(q[..., :v], self.target.vocab_size)
        out[..., torch.tensor(self.copy_ids, dtype=torch.long, device=q.device)] = q[..., v:]
        return out

    def _draw(self, logits: torch.Tensor, temperature: float) -> tuple[int, torch.Tensor | None]:
        """One chain token from a logits row over the head's vocab, with this request's generator: (its target
        id, q over the target's vocab, None when greedy)."""
        tok_h, q = draft_token(logits, temperature, self.generator)
        tok = int(self._to_ids(torch.tensor(tok_h, device=self.device)))
        return tok, None if q is None else self._to_probs(q)

    @staticmethod
    def _check(tokens: list[int], features: Features | None) -> Features:
        if features is None or features.last.shape[1] != len(tokens):
            got = None if features is None else features.last.shape[1]
            raise ValueError(f"EAGLE drafter: expected features for {len(tokens)} positions, got {got}")
        return features

    def _extend(self, tokens: list[int], features: Features | None) -> None:
        m = len(tokens)
        features = self._check(tokens, features)
        feats = Features(last=features.last.to(self.device),
                         aux=None if features.aux is None else features.aux.to(self.device))
        hidden = self.head.project(feats)
        self._remember(tokens, feats.last)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(self.n, self.n + m, device=self.device)
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        o = self._rows(ids, hidden, pos, torch.cat([torch.ones(m, self.n, dtype=torch.bool), causal], dim=1))
        self.n += m
        self.last_o = o[:, -1:]
        self.last_logits = self._logits(self.last_o)[0, 0]

    # -- protocol
    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self.cache = DynamicCache()
        self.n = 0
        self.tree_tokens, self.ready, self.held = [], None, None
        ids = prompt_ids.reshape(-1).tolist()
        self.copy_ids, self.ptr_keys, self.ptr_ext = [], None, None
        self._extend(ids[1:] + [int(next_token)], features)

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens([self.tree_tokens[i] for i in accepted], features, next_token)

    @torch.no_grad()
    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        # Draft rows are never kept, so any path is committed alike: its rows come from the target's features.
        self.tree_tokens, self.ready = [], None
        path = [int(t) for t in tokens] + [int(next_token)]
        if not self.hold:
            self._extend(path, features)
            return
        # An earlier held commit goes first. The features are held as given: the batched decoder's are never
        # written again (data.kvcache.DynamicKV allocates every forward); DeferredSync copies what it defers.
        self._settle()
        self.held = (path, self._check(path, features))

    def _settle(self) -> None:
        """Run the held commit, if any."""
        if self.held is not None:
            (path, features), self.held = self.held, None
            self._extend(path, features)

    @torch.no_grad()
    def draft(self, k: int, temperature: float) -> DraftTree:
        self._settle()
        if self.last_logits is None:
            raise RuntimeError("EAGLE drafter: draft() before begin()")
        depth = min(k, self.depth) if self.depth else k
        ready, self.ready = self.ready, None
        if ready is not None and ready[:2] == (depth, temperature):
            self.tree_tokens = ready[2].tokens.tolist()
            return ready[2]
        if depth <= 0:
            self.tree_tokens = []
            return DraftTree.chain(torch.empty(0, dtype=torch.long, device=self.device))
        try:
            if self.tree == "dynamic":
                return self._draft_dynamic(depth, temperature)
            return self._draft_chain(depth, temperature)
        finally:
            crop_to(self.cache, self.n)  # drop the draft rows: only committed rows stay

    def nodes(self, k: int) -> int:
        """How many nodes draft(k) returns (heads.types.Drafter; eval.policy prices a pass by it): a chain's
        depth; a dynamic tree's `total_tokens`, or fewer when its depth generates fewer candidates (top_k at
        the first depth, top_k^2 at each one after)."""
        depth = min(k, self.depth) if self.depth else k
        if self.tree == "chain":
            return max(depth, 0)
        return dynamic_nodes(self._width(), depth, self.total_tokens)

    def _width(self) -> int:
        """Children per expanded node of a dynamic tree: top_k, or the head's whole vocabulary if smaller."""
        return self.top_k if self.last_logits is None else min(self.top_k, self.last_logits.numel())

    def _draft_chain(self, k: int, temperature: float) -> DraftTree:
        logits, hidden = self.last_logits, self.last_o
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            tok, q = self._draw(logits, temperature)
            tokens.append(tok)
            if q is not None:
                probs.append(q)
            if j == k - 1:
                break
            pos = torch.tensor([self.n + j])  # d_{j+1} sits at depth j+1, position n-1+(j+1)
            # it sees the n committed rows, the j earlier draft rows and itself
            hidden = self._rows(torch.tensor([tok], device=self.device), hidden, pos,
                                torch.ones(1, self.n + j + 1, dtype=torch.bool))
            logits = self._logits(hidden)[0, 0]
        self.tree_tokens = tokens
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return DraftTree.chain(t, torch.stack(probs) if probs else None)

    @staticmethod
    @torch.no_grad()
    def draft_together(drafters: list[EagleDrafter], ks: list[int], temperature: float) -> None:
        """Draft the chains of several requests at once (the batched decoder's rows: eval.batch), one head pass
        per depth for all of them; drafter i's next draft(ks[i], temperature) returns its chain, the one its
        own draft would make (the same rows, positions and keys: each request attends to its own committed
        rows, padded to the longest and masked, and to its own draft rows). Requests are grouped by head; dynamic
        trees, a depth cap that binds, or a drafter not begun are left to their own draft. Held commits are
        settled first, together (settle_together)."""
        EagleDrafter.settle_together([d for d, k in zip(drafters, ks) if k > 0])
        by_head: dict[int, list[tuple[EagleDrafter, int]]] = {}
        for d, k in zip(drafters, ks):
            if k > 0 and d.tree == "chain" and d.last_logits is not None and not (d.depth and d.depth < k):
                by_head.setdefault(id(d.head), []).append((d, k))
        for rows in by_head.values():
            if len(rows) > 1:
                EagleDrafter._draft_rows(rows, temperature)

    @staticmethod
    def _draft_rows(rows: list[tuple[EagleDrafter, int]], temperature: float) -> None:
        """draft_together for requests of one head: (drafter, k) each."""
        first = rows[0][0]
        head, target, dev, depth = first.head, first.target, first.device, max(k for _, k in rows)
        b = len(rows)
        keys, vals, seen = EagleDrafter._committed([d for d, _ in rows])
        n = torch.tensor([d.n for d, _ in rows], device=dev)
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        logits = [d.last_logits for d, _ in rows]
        hidden = torch.cat([d.last_o for d, _ in rows])  # [b, 1, H]
        emb_dev = next(target.embed.parameters()).device
        for j in range(depth):
            for i, (d, k) in enumerate(rows):
                if j >= k:  # this request's chain is complete (its generator draws no more than its own draft's)
                    continue
                tok, q = d._draw(logits[i], temperature)
                tokens[i].append(tok)
                if q is not None:
                    probs[i].append(q)
            if j == depth - 1:
                break
            # d_{j+1} of every request at its own position n-1+(j+1), one head row each
            emb = target.embed(torch.tensor([[t[-1]] for t in tokens], device=emb_dev)).to(dev)
            cos, sin = rotary(target, hidden, (n + j)[:, None])
            q, k, v, resid = head.rows(emb, hidden, cos, sin)
            keys, vals = torch.cat([keys, k], dim=2), torch.cat([vals, v], dim=2)
            seen = torch.cat([seen, torch.ones(b, 1, dtype=torch.bool, device=dev)], dim=1)
            hidden = head.layer.finish(masked_attention(q, keys, vals, seen[:, None, None, :]), resid)
            logits = EagleDrafter._logits_of([d for d, _ in rows], hidden)
        for i, (d, k) in enumerate(rows):
            t = torch.tensor(tokens[i], dtype=torch.long, device=dev)
            d.ready = (k, temperature, DraftTree.chain(t, torch.stack(probs[i]) if probs[i] else None))

    @staticmethod
    def _committed(drafters: list[EagleDrafter]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The requests' committed keys and values padded to the longest, [b, kv_heads, longest, d] each, and
        seen [b, longest]: which of them are a request's own (draft_together and settle_together attend over
        them)."""
        return pad_requests([(d.cache.layers[0].keys, d.cache.layers[0].values) for d in drafters])

    @staticmethod
    @torch.no_grad()
    def settle_together(drafters: list[EagleDrafter]) -> None:
        """Run the held commits of several requests (`hold`: the batched decoder's rows) in one head pass per
        head: each request's path rows padded to the longest path, each attending to its own committed rows
        (padded to the longest and masked) and causally to its own path, at its own positions; each request
        keeps its real rows' keys and its last row's output. The state is the one its own commit makes."""
        by_head: dict[int, list[EagleDrafter]] = {}
        for d in drafters:
            if d.held is not None:
                by_head.setdefault(id(d.head), []).append(d)
        for rows in by_head.values():
            if len(rows) == 1:
                rows[0]._settle()
            else:
                EagleDrafter._extend_rows(rows)

    @staticmethod
    def _extend_rows(rows: list[EagleDrafter]) -> None:
        """settle_together for requests of one head, each with a held commit."""
        first = rows[0]
        head, target, dev = first.head, first.target, first.device
        held = [d.held for d in rows]
        for d in rows:
            d.held = None
        lens = [len(path) for path, _ in held]
        b, m = len(rows), max(lens)

        def padded(parts: list[torch.Tensor]) -> torch.Tensor:  # [1, len, ...] each -> [b, m, ...], zeros after
            out = parts[0].new_zeros(b, m, *parts[0].shape[2:])
            for i, t in enumerate(parts):
                out[i, :t.shape[1]] = t[0]
            return out

        feats = [f for _, f in held]
        aux = None if feats[0].aux is None else padded([f.aux.to(dev) for f in feats])
        hidden = head.project(Features(last=padded([f.last.to(dev) for f in feats]), aux=aux))
        ids = torch.zeros(b, m, dtype=torch.long)
        for i, (path, _) in enumerate(held):
            ids[i, :len(path)] = torch.tensor(path)
        pos = torch.tensor([d.n for d in rows])[:, None] + torch.arange(m)
        emb = target.embed(ids.to(next(target.embed.parameters()).device)).to(dev)
        cos, sin = rotary(target, hidden, pos.to(dev))
        q, k, v, resid = head.rows(emb, hidden, cos, sin)
        keys, vals, seen = EagleDrafter._committed(rows)
        keys, vals = torch.cat([keys, k], dim=2), torch.cat([vals, v], dim=2)
        causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()  # each path row sees its path so far
        mask = torch.cat([seen[:, None, None, :].expand(b, 1, m, -1), causal.expand(b, 1, m, m)], dim=-1)
        o = head.layer.finish(masked_attention(q, keys, vals, mask), resid)  # [b, m, H]; rows past a path unread
        last = torch.cat([o[i:i + 1, n - 1:n] for i, n in enumerate(lens)])  # [b, 1, H]
        for d, (path, f) in zip(rows, held):
            d._remember(path, f.last)
        logits = EagleDrafter._logits_of(rows, last)
        for i, (d, n) in enumerate(zip(rows, lens)):
            d.cache.update(k[i:i + 1, :, :n], v[i:i + 1, :, :n], 0)
            d.n += n
            d.last_o, d.last_logits = last[i:i + 1], logits[i]

    @staticmethod
    def _logits_of(drafters: list[EagleDrafter], o: torch.Tensor) -> list[torch.Tensor]:
        """The logits row of each request's output o[i] [1, H] (one pass for all, or one each for a
        head.pointer head: every request has its own copy tokens)."""
        if drafters[0].ptr_keys is None:
            return list(drafters[0]._logits(o)[:, 0])
        return [d._logits(o[i:i + 1])[0, 0] for i, d in enumerate(drafters)]

    def _draft_dynamic(self, depth: int, temperature: float) -> DraftTree:
        tree = grow_dynamic(self.last_logits, self._expand, depth, self._width(), self.total_tokens, temperature,
                            self._to_ids, self._to_probs)
        self.tree_tokens = tree.tokens.tolist()
        return tree

    def _expand(self, pool: CandidatePool, expand: list[int]) -> torch.Tensor:
        """Run the draft rows of the nodes `expand` (the best of one depth) in one pass; returns their logits
        [len(expand), head vocab], from which their children are proposed."""
        nodes = [pool.nodes[i] for i in expand]
        m = len(nodes)
        toks = self._to_ids(torch.tensor([c.token for c in nodes], device=self.device))
        # each expanded node's state: (the draft rows its row sees, its own included; its PRE-norm output)
        hidden = torch.cat([self.last_o if c.parent < 0 else pool.nodes[c.parent].state[1] for c in nodes], dim=1)
        pos = torch.tensor([self.n - 1 + c.depth for c in nodes])  # depth-d rows at n-1+d, as in a chain
        anc = torch.zeros(m, pool.rows, dtype=torch.bool)  # which earlier draft rows each new row sees
        for r, c in enumerate(nodes):
            if c.parent >= 0:
                anc[r, pool.nodes[c.parent].state[0]] = True
        mask = torch.cat([torch.ones(m, self.n, dtype=torch.bool), anc, torch.eye(m, dtype=torch.bool)], dim=1)
        o = self._rows(toks, hidden, pos, mask)
        for r, c in enumerate(nodes):
            c.state = (anc[r].nonzero().reshape(-1).tolist() + [pool.rows + r], o[:, r : r + 1])
        pool.rows += m
        return self._logits(o)[0]


def drafter(head: nn.Module, target: TargetIO, **kw: Any) -> EagleDrafter:
    """The decoder adapter: tree="chain" | "dynamic", top_k, total_tokens, depth, generator (see EagleDrafter)."""
    return EagleDrafter(head, target, **kw)


def drafter_factory(head: nn.Module, target: TargetIO, tree: str = "auto", k: int = 4, topk: int = 10,
                    tokens: int = 60) -> Callable[[], EagleDrafter]:
    """Fresh drafters for eval.tree: auto (a chain; the eval may first resolve auto to a dynamic tree sized by the
    verify curve, eval.calibrate.choose_tree), chain or dynamic (EAGLE-2: `topk` children per
    expanded node, `tokens` nodes verified; eval.tree_topk and eval.tree_tokens); `k` is unused (the depth
    comes with each draft call). Any other tree raises HeadError naming the head's family."""
    check_eval_tree(tree, head.family, TREES)
    kw: dict[str, Any] = {} if tree == "auto" else {"tree": tree}
    if tree == "dynamic":
        kw.update(top_k=topk, total_tokens=tokens)
    return lambda: drafter(head, target, **kw)
