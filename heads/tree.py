"""Draft-tree utilities shared by the decoder (eval.decoder) and the tree-drafting heads (Medusa, EAGLE-2, DFlash).

A tree hangs below the ROOT, the last committed token that the target has not seen yet. Nodes are numbered
0..N-1 in topological order (parents first); `parents[i]` is the parent node of node i, -1 for children of the
root. In one verification pass the target reads [root, node 0, ..., node N-1], so node i sits at row i+1 of
the verify input; every helper here that includes the root puts it at index 0.

    tree_layout(parents)  -> (ancestor mask [N+1, N+1] with the root at 0, depths [N] with root children = 1)
    is_chain(parents)     -> True for parents [-1, 0, 1, ..., N-2] (verified with the ordinary causal mask)
    StaticTree(choices)   -> a fixed Medusa-style tree; .build(candidates, probs) makes a DraftTree per step
    grow_dynamic(root_logits, expand, depth, top_k, total, temperature, to_ids, to_probs)
                          -> EAGLE-2's dynamic tree over a CandidatePool (the EAGLE and DFlash drafters' trees;
                             `expand` is the drafter's: the logits of the children of some nodes of one depth)
    dynamic_nodes(width, depth, total) -> how many nodes such a tree can hold (the policy prices a pass by it)

Medusa-style choices are paths of top-k ranks, one rank per depth: [[0], [1], [0, 0]] is a tree whose root has
two children (the rank-0 and rank-1 candidates of depth 1) and whose rank-0 child has one child (the rank-0
candidate of depth 2). This module imports neither eval nor data: heads build their trees with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from heads.sampling import draft_distribution
from heads.types import DraftTree

# A small default static tree (15 nodes, depth 5): wide near the root where candidates disagree most,
# a single spine deeper down where only the best path is worth a verify slot on a CPU.
DEFAULT_CHOICES: list[list[int]] = [
    [0], [1], [2],
    [0, 0], [0, 1], [1, 0], [2, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 1, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


def check_parents(parents: Sequence[int], where: str = "DraftTree.parents") -> None:
    """Raise ValueError unless every parent index is -1 or an EARLIER node (topological order)."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"{where}: node {i} has parent {p}; parents must be -1 or an earlier node index")


@lru_cache(maxsize=256)
def _layout(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    check_parents(parents)
    n = len(parents)
    anc = torch.eye(n + 1, dtype=torch.bool)
    anc[:, 0] = True  # everything sees the root
    depths = [0] * (n + 1)
    for i, p in enumerate(parents):
        # Row p+1 is complete already (parents come first), so OR-ing it in gives all ancestors of node i.
        anc[i + 1] |= anc[p + 1]
        depths[i + 1] = depths[p + 1] + 1
    return anc, torch.tensor(depths[1:], dtype=torch.long)


def tree_layout(parents: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor mask and depths of a tree, memoised per shape (static trees pay once).

    Returns (mask, depths): mask [N+1, N+1] bool with mask[i, j] True iff row j is row i or an ancestor of it
    (row 0 = root, row i+1 = node i); depths [N] long, 1 for children of the root.
    Example: parents [-1, 0, -1] (root -> a -> b, root -> c) gives depths [1, 2, 1] and mask rows
    root: [1 0 0 0], a: [1 1 0 0], b: [1 1 1 0], c: [1 0 0 1]. Treat both results as read-only.
    """
    key = tuple(parents.tolist()) if isinstance(parents, torch.Tensor) else tuple(int(p) for p in parents)
    return _layout(key)


def is_chain(parents: torch.Tensor) -> bool:
    """True for the chain layout [-1, 0, 1, ..., N-2] (also for N = 0)."""
    n = parents.numel()
    return n == 0 or bool(torch.equal(parents.cpu(), torch.arange(-1, n - 1)))


def tree_depth(parents: torch.Tensor) -> int:
    """The longest root-to-leaf path (0 for an empty tree)."""
    if is_chain(parents):
        return int(parents.numel())
    return int(tree_layout(parents)[1].max())


class StaticTree:
    """A fixed tree shape from a Medusa-style choices list (see the module docstring).

    Paths are sorted by (length, ranks) so parents come first; every proper prefix of a path must itself be
    a path (e.g. [0, 1] needs [0]). Per step, `build` fills the shape with per-depth candidates.
    """

    def __init__(self, choices: Sequence[Sequence[int]] = DEFAULT_CHOICES):
        paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        if not paths:
            raise ValueError("StaticTree: the choices list is empty")
        if len(paths) != len(choices):
            raise ValueError("StaticTree: the choices list holds a duplicate path")
        index = {p: i for i, p in enumerate(paths)}
        parents = []
        for p in paths:
            if not p or min(p) < 0:
                raise ValueError(f"StaticTree: path {list(p)} must be a non-empty list of ranks >= 0")
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"StaticTree: path {list(p)} has no parent path {list(p[:-1])} in the choices")
            parents.append(index[p[:-1]] if len(p) > 1 else -1)
        self.paths: list[tuple[int, ...]] = paths
        self.parents = torch.tensor(parents, dtype=torch.long)
        self.depth_index = torch.tensor([len(p) - 1 for p in paths], dtype=torch.long)  # 0-based depth
        self.ranks = torch.tensor([p[-1] for p in paths], dtype=torch.long)
        self.depth = max(len(p) for p in paths)
        self.topk = max(p[-1] for p in paths) + 1  # candidates needed per depth

    def __len__(self) -> int:
        return len(self.paths)

    def truncate(self, depth: int) -> StaticTree:
        """The same tree cut to paths of at most `depth` ranks (depth >= 1); the tree itself when it is no deeper
        (the drafters cut their shape to each draft's length)."""
        if depth < 1:
            raise ValueError(f"StaticTree.truncate: depth must be >= 1, got {depth}")
        if depth >= self.depth:
            return self
        return StaticTree([p for p in self.paths if len(p) <= depth])

    def build(self, candidates: torch.Tensor, probs: torch.Tensor | None = None) -> DraftTree:
        """Fill the shape: node with path (r1, ..., rd) gets candidates[d-1, rd].

        candidates [D, K] long: top-K tokens per depth, best first (D >= self.depth, K >= self.topk).
        probs [D, V] or None: the drafter's distribution per depth; node probs are the row of its depth.
        The tree is marked sampling="topk" (distinct deterministic candidates per depth).
        """
        if candidates.dim() != 2 or candidates.shape[0] < self.depth or candidates.shape[1] < self.topk:
            raise ValueError(
                f"StaticTree.build: candidates must be [>= {self.depth}, >= {self.topk}], got {tuple(candidates.shape)}"
            )
        dev = candidates.device
        tokens = candidates[self.depth_index.to(dev), self.ranks.to(dev)]
        node_probs = None if probs is None else probs[self.depth_index.to(probs.device)]
        return DraftTree(tokens=tokens, parents=self.parents.to(dev), probs=node_probs, sampling="topk")


def tree_from_choices(
    choices: Sequence[Sequence[int]], candidates: torch.Tensor, probs: torch.Tensor | None = None
) -> DraftTree:
    """One-off `StaticTree(choices).build(candidates, probs)` (keep a StaticTree to reuse the shape)."""
    return StaticTree(choices).build(candidates, probs)


@dataclass
class Candidate:
    """One node of an EAGLE-2 dynamic tree while it grows (see CandidatePool)."""

    token: int  # the drafted token, a HEAD-vocab id
    parent: int  # pool index of its parent node, -1 for a child of the root
    score: float  # cumulative draft log-prob from the root
    depth: int  # 1 for a child of the root
    q: int  # index into CandidatePool.qs of the distribution it was drawn from (its parent's); -1 when greedy
    state: Any = None  # once expanded: what the drafter keeps for its children (EAGLE: its draft row and output)


class CandidatePool:
    """The nodes of an EAGLE-2 tree in creation order, the distributions they were drawn from, and how many
    draft rows the expanded nodes occupy (EAGLE's head cache rows; a drafter that keeps none leaves it 0)."""

    def __init__(self, top_k: int, temperature: float):
        self.top_k, self.temperature = top_k, temperature
        self.nodes: list[Candidate] = []
        self.qs: list[torch.Tensor] = []
        self.rows = 0

    def add_children(self, logits: torch.Tensor, parent: int) -> list[int]:
        """The `top_k` best children of `parent` (-1 = the root) under `logits`; returns their pool indices."""
        base, depth = (0.0, 1) if parent < 0 else (self.nodes[parent].score, self.nodes[parent].depth + 1)
        if self.temperature > 0:
            self.qs.append(draft_distribution(logits, self.temperature))
        top = logits.log_softmax(-1).topk(self.top_k)
        start = len(self.nodes)
        for val, idx in zip(top.values.tolist(), top.indices.tolist()):
            self.nodes.append(Candidate(idx, parent, base + val, depth, len(self.qs) - 1))
        return list(range(start, len(self.nodes)))

    def best(self, frontier: list[int]) -> list[int]:
        """The `top_k` nodes of `frontier` with the highest scores (stable: earlier nodes win ties)."""
        return sorted(frontier, key=lambda i: -self.nodes[i].score)[: self.top_k]

    def cutoff(self, total: int) -> float:
        """The `total`-th best score so far (-inf while there are fewer nodes). It only rises as nodes are added,
        and a node scoring below it can never be selected, nor can its descendants (a child never scores above
        its parent): expanding it is wasted head work, and leaving it unexpanded changes no selection."""
        if len(self.nodes) < total:
            return float("-inf")
        return sorted((c.score for c in self.nodes), reverse=True)[total - 1]

    def select(self, total: int) -> tuple[list[int], list[int]]:
        """The `total` best nodes in tree order (depth, then creation), and each one's parent among them.

        A child never scores above its parent (log-probs <= 0) and ties go to the shallower node, so the
        selection always includes every selected node's ancestors."""
        nodes = self.nodes
        chosen = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:total]
        chosen.sort(key=lambda i: (nodes[i].depth, i))
        new_index = {node: j for j, node in enumerate(chosen)}
        return chosen, [-1 if nodes[i].parent < 0 else new_index[nodes[i].parent] for i in chosen]


def grow_dynamic(root_logits: torch.Tensor, expand: Callable[[CandidatePool, list[int]], torch.Tensor], depth: int,
                 top_k: int, total: int, temperature: float, to_ids: Callable[[torch.Tensor], torch.Tensor],
                 to_probs: Callable[[torch.Tensor], torch.Tensor]) -> DraftTree:
    """EAGLE-2's dynamic tree of at most `total` nodes and `depth` levels: the root's `top_k` best children under
    root_logits [head vocab]; then per depth the `top_k` best nodes of the newest depth by cumulative draft
    log-prob, those that can still make the selection (CandidatePool.cutoff), each proposing its `top_k` best
    children under its row of expand(pool, nodes) [len(nodes), head vocab]; finally the `total` best nodes of
    all depths (ancestor-closed: a child never scores above its parent). Children are deterministic top-k,
    so the tree is marked sampling="topk", each node's q its parent's distribution when temperature > 0.
    to_ids / to_probs map head-vocab ids and distributions to the target's (a draft vocabulary's d2t)."""
    pool = CandidatePool(top_k, temperature)
    frontier = pool.add_children(root_logits, -1)
    for _ in range(2, depth + 1):  # the children of depth 2 .. depth
        floor = pool.cutoff(total)
        grown = [i for i in pool.best(frontier) if pool.nodes[i].score >= floor]
        if not grown:  # no deeper node can make the selection
            break
        logits = expand(pool, grown)
        frontier = [c for r, i in enumerate(grown) for c in pool.add_children(logits[r], i)]
    chosen, parents = pool.select(total)
    dev = root_logits.device
    tokens = to_ids(torch.tensor([pool.nodes[i].token for i in chosen], device=dev))
    probs = None if temperature <= 0 else to_probs(torch.stack([pool.qs[pool.nodes[i].q] for i in chosen]))
    return DraftTree(tokens=tokens, parents=torch.tensor(parents, dtype=torch.long, device=dev), probs=probs,
                     sampling="topk")


def dynamic_nodes(width: int, depth: int, total: int) -> int:
    """How many nodes grow_dynamic returns at most: `total`, or fewer when `depth` levels of `width` children
    per expanded node hold fewer (width at the first depth, width * width at each one after)."""
    return 0 if depth <= 0 else min(total, width + width * width * (depth - 1))
