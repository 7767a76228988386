"""Speculative sampling is exact: its samples follow the target's distribution as closely as plain sampling does.

Setup (docs/science.md, "How exactness is tested"): a 4-token language, sequences of length 4 (256 outcomes with exactly
computable probabilities), a random bigram target p and a draft q = target blended with noise. N sequences are
drawn through the production acceptance rule `eval.decoder.verify_tree` (chains, i.i.d. trees, deterministic
top-k trees) and compared with the exact distribution by total variation and a chi-square test (cells with
expected count < 5 pooled), at fixed seeds and N; plain target sampling at the same N is the yardstick.
The "resample from plain p after a rejection" variant (swapped in by monkeypatching the rejection update)
must fail the same test. The real decoder loop, for every drafter, is checked in tests/test_sampling_drafters.py.

    .venv/bin/python -m pytest -q tests/test_sampling_exactness.py
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch
from drafters_common import chi_square_pvalue

import eval.decoder as decoder
from eval.decoder import verify_tree
from heads.base import DraftTree

V, L, N = 4, 4, 6_000
START = 0  # the token before the first sampled one


# ----------------------------------------------------------------------------------------------- statistics
def total_variation(counts: Counter, probs: dict[tuple, float], n: int) -> float:
    return 0.5 * sum(abs(counts.get(c, 0) / n - p) for c, p in probs.items())


# ----------------------------------------------------------------------------------------------- toy language
def _bigrams(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    noise = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    return p.float(), (0.5 * p + 0.5 * noise).float()


def exact_distribution(p: torch.Tensor) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        prob, prev = 1.0, START
        for t in seq:
            prob *= float(p[prev, t])
            prev = t
        out[seq] = prob
    return out


def plain_counts(p: torch.Tensor, n: int, seed: int) -> Counter:
    """Plain target sampling, vectorised over the n sequences."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.full((n,), START)
    cols = []
    for _ in range(L):
        prev = torch.multinomial(p[prev], 1, generator=g)[:, 0]
        cols.append(prev)
    return Counter(map(tuple, torch.stack(cols, 1).tolist()))


def _draw(rng: random.Random, row: list[float]) -> int:
    return rng.choices(range(V), weights=row)[0]


def _draft_tokens(mode: str, prev: int, q: torch.Tensor, qlist: list[list[float]], rng: random.Random) -> tuple:
    """Depth-2 drafts below the root `prev` as (tokens, parents):
    chain        x1 ~ q(.|prev), x2 ~ q(.|x1)                         (probs given, i.i.d.)
    greedy_chain the two argmax steps of q                             (probs None: deterministic)
    iid_tree     two i.i.d. children of the root, one i.i.d. child each  (SpecInfer)
    topk_tree    the top-2 children of the root, the top-1 child of each (EAGLE)
    """
    if mode == "chain":
        a = _draw(rng, qlist[prev])
        return (a, _draw(rng, qlist[a])), (-1, 0)
    if mode == "greedy_chain":
        a = int(q[prev].argmax())
        return (a, int(q[a].argmax())), (-1, 0)
    if mode == "iid_tree":
        a, b = _draw(rng, qlist[prev]), _draw(rng, qlist[prev])
        return (a, b, _draw(rng, qlist[a]), _draw(rng, qlist[b])), (-1, -1, 0, 1)
    if mode == "topk_tree":
        a, b = torch.topk(q[prev], 2).indices.tolist()
        return (a, b, int(q[a].argmax()), int(q[b].argmax())), (-1, -1, 0, 1)
    raise ValueError(mode)


_TREES: dict[tuple, DraftTree] = {}


def draft_tree(mode: str, prev: int, q: torch.Tensor, qlist: list[list[float]], rng: random.Random) -> DraftTree:
    """The DraftTree of `_draft_tokens`, memoised (a 4-token language has few distinct drafts).

    Node probs are q at each node's parent; greedy_chain gives none (deterministic drafts).
    """
    toks, parents = _draft_tokens(mode, prev, q, qlist, rng)
    key = (mode, prev, toks, id(q))
    if key not in _TREES:
        at = [prev if par < 0 else toks[par] for par in parents]  # the token each node was drafted after
        probs = None if mode == "greedy_chain" else q[at]
        sampling = "topk" if mode == "topk_tree" else "iid"
        _TREES[key] = DraftTree(torch.tensor(toks), torch.tensor(parents), probs, sampling)
    return _TREES[key]


def speculative_counts(mode: str, p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> tuple[Counter, float]:
    """n sequences of length L through verify_tree; also returns tau (tokens per verification)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    qlist = q.tolist()
    rows_at: dict[tuple, torch.Tensor] = {}
    counts: Counter = Counter()
    passes = tokens = 0
    for _ in range(n):
        seq: list[int] = []
        prev = START
        while len(seq) < L:
            tree = draft_tree(mode, prev, q, qlist, rng)
            toks = tree.tokens.tolist()
            key = (prev, *toks)
            if key not in rows_at:
                rows_at[key] = p[list(key)]  # bigram: row 0 at the root, row i+1 at node i
            accepted, nxt = verify_tree(tree, rows_at[key], 1.0, g)
            new = [toks[a] for a in accepted] + [nxt]
            seq += new
            prev = seq[-1]
            passes, tokens = passes + 1, tokens + len(new)
        counts[tuple(seq[:L])] += 1
    return counts, tokens / passes


def _resample_from_p(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """The classic bug: after a rejection, sample the replacement from the unchanged target p."""
    return p


MODES = ["chain", "greedy_chain", "iid_tree", "topk_tree"]


@pytest.fixture(scope="module")
def toy():
    p, q = _bigrams(seed=7)
    exact = exact_distribution(p)
    plain = plain_counts(p, N, seed=1)
    return p, q, exact, total_variation(plain, exact, N), chi_square_pvalue(exact, plain, N)


def test_plain_sampling_is_the_yardstick(toy):
    _, _, _, tv_plain, pv_plain = toy
    assert 0.005 < tv_plain < 0.06 and pv_plain > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_speculative_sampling_matches_exact_distribution(toy, mode):
    p, q, exact, tv_plain, _ = toy
    counts, tau = speculative_counts(mode, p, q, N, seed=11)
    assert tau > 1.3  # the drafts really are being accepted, not just corrected
    tv = total_variation(counts, exact, N)
    pv = chi_square_pvalue(exact, counts, N)
    assert pv > 1e-3, f"{mode}: chi-square p = {pv:.2e}"
    assert tv < 1.5 * tv_plain, f"{mode}: TV {tv:.4f} vs plain sampling {tv_plain:.4f}"


@pytest.mark.parametrize("mode", MODES)
def test_resampling_from_plain_p_fails_the_same_test(toy, mode, monkeypatch):
    p, q, exact, tv_plain, _ = toy
    monkeypatch.setattr(decoder, "residual_distribution", _resample_from_p)
    counts, _ = speculative_counts(mode, p, q, N, seed=11)
    tv = total_variation(counts, exact, N)
    pv = chi_square_pvalue(exact, counts, N)
    assert pv < 1e-6 and tv > 2 * tv_plain, f"{mode}: the biased sampler passed (p = {pv:.2e}, TV {tv:.4f})"
