"""Draft-tree utilities shared by the decoder (eval.decoder) and the tree-drafting heads (Medusa, EAGLE-2).

A tree hangs below the ROOT, the last committed token that the target has not seen yet. Nodes are numbered
0..N-1 in topological order (parents first); `parents[i]` is the parent node of node i, -1 for children of the
root. In one verification pass the target reads [root, node 0, ..., node N-1], so node i sits at row i+1 of
the verify input; every helper here that includes the root puts it at index 0.

    tree_layout(parents)  -> (ancestor mask [N+1, N+1] with the root at 0, depths [N] with root children = 1)
    is_chain(parents)     -> True for parents [-1, 0, 1, ..., N-2] (verified with the ordinary causal mask)
    StaticTree(choices)   -> a fixed Medusa-style tree; .build(candidates, probs) makes a DraftTree per step

Medusa-style choices are paths of top-k ranks, one rank per depth: [[0], [1], [0, 0]] is a tree whose root has
two children (the rank-0 and rank-1 candidates of depth 1) and whose rank-0 child has one child (the rank-0
candidate of depth 2). This module imports neither eval nor data: heads build their trees with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

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
