"""Per-request adaptive drafting: each pass's draft length from what THIS request has accepted so far.

    from eval.policy import AdaptivePolicy
    policy = AdaptivePolicy(verify, {"draft": cal.draft_cost}, {"draft": cal.acceptance})
    ids, stats = speculative_generate(model, prompt, drafter, k, 128, policy=policy)
    print(stats.chosen_k)        # {"draft": {0: passes without a draft, 1: ..., 2: ...}}

For a HybridDrafter (eval.drafters) the proposers are "head" and "ngram", each with its own prior and draft
cost, and the policy sizes both branches of every pass (the decoder hands its choice to `draft` as `budgets`).
A drafter may also name what a proposal is priced as (`proposal_key`): the hybrid keys the n-gram's by its
match order, so a 3-token match and a 1-token one each get their own a_s(d) (both start from the n-gram's
prior); "the proposer s" below is that key.

The model (eval.costs, per proposer s and depth d, the estimate a_s(d) of P(depth d accepted | d-1 was)):
    a_s(d)   = (accepted_s(d) + w * prior_s(d)) / (judged_s(d) + w)     counts decay by `decay` per
                                                                        observation, so a request that
                                                                        changes character is followed
    P_s(d)   = a_s(1) * ... * a_s(d)                                    the proposer's chain reaches depth d
    E(l)     = 1 + sum_d (1 - prod_s (1 - P_s(d) [d <= l_s]))           tokens per pass, branches treated as
                                                                        independent chances to reach depth d
    time(l)  = sum_{s: l_s > 0} D_s(nodes_s) + T(1 + sum_s nodes_s)     nodes_s = l_s * nodes per depth seen,
                                                                        or the drafter's own count (node_count)
    D_s(m)   = calibration's draft cost(m) * draft_scale(s)             observed / priced drafting seconds of
                                                                        s in this request (observe_drafting)
and the lengths l (each 0..k_max, the n-gram's capped by the match it actually has, a block drafter's by its
max_depth, heads.types.Drafter) with the highest E(l) * T(1) / time(l) are drafted; all zero is a plain pass
(T(1), E = 1), unless a one-token draft would pay at an optimistic first-depth rate, a_s(1) plus `explore_z`
standard deviations of its Beta posterior (pseudo-count the decayed judgments plus w): then that one token is
drafted (`explore`), so a few chance rejections early in a request cannot turn a useful head off, while one
rejected every time stops within a dozen passes (a proposal known before drafting, the n-gram's match, is not
explored: see the re-probes below). A proposer left at 0 for `probe_every` passes in a row is given depth 1 once
(a cheap re-probe: one extra verified token; a proposal known before drafting, the n-gram's match, is probed
whole: it costs nothing to draft and its worth is in its deep positions, which one token would never measure), so
a request that becomes predictable gets drafts again; while probes do not bring it back the gap doubles
(8, 16, 32, 64 passes), so a drafter that never helps costs little more than plain decoding. The prior is the
calibration's acceptance, which is what the calibrated k was chosen from (in the eval, with the benchmark's earlier
turns' counts added: eval.turns.adaptive_policy); reset's k is the first pass's length.

The verify curve T(n) starts as eval.costs' probe (a few timed forwards on a synthetic context before the
run) and learns from the run itself: every verify pass the decoder times is an observation of T(1 + nodes)
at the request's real context, on the machine as loaded as it is now. It is learned as a level times a shape:
    T(n)     = level * ratio(n)
    ratio(n) = (w_T * probe(n) / probe(1) + sum of decayed samples) / (w_T + decayed count)    a sample: two
               consecutive passes of sizes m < n, y_n / y_m * (m's samples' mean, or the probe's ratio; 1 for
               m = 1): the machine's drift cancels in it
    level    = decayed mean of y / ratio(n) over every timed pass                               decay `decay`
(w_T = `probe_weight`), refitted nondecreasing (isotonic) after each pass: eval.policy.LearnedVerifyCost, one
per run shared by every request's policy (the machine, not the request, sets the cost). This keeps a probe
taken in a quiet (or busy) moment from steering a whole run, follows the context growing during a request,
and never reads a slow spell's T(1) against a fast spell's T(4) as a free tree.

Exactness does not depend on any of this: the policy only chooses what is drafted (tests/test_policy.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from eval.costs import DraftCost, VerifyCost, shrunk_rates, speedup
from eval.decoder import GenerationStats
from eval.speedup import extend_rates
from heads.base import DraftTree

__all__ = ["AdaptivePolicy", "LearnedVerifyCost", "depth_limit", "isotonic", "measured_prior", "node_count"]

MAX_PROBE_GAP_FACTOR = 8  # re-probes back off from probe_every to at most 8 * probe_every plain passes


def _stated(drafter: Any, source: str, name: str) -> Any:
    """What `drafter` states as `name` for `source`: a multi-proposer drafter's `<name>_of(source)`, else its own
    `name` attribute; None where it states nothing."""
    of = getattr(drafter, f"{name}_of", None)
    return of(source) if of is not None else getattr(drafter, name, None)


def node_count(drafter: Any, source: str = "draft") -> Callable[[int], int] | None:
    """How many nodes `source` of `drafter` drafts at each length, where the drafter says (heads.types.Drafter's
    `nodes`: EAGLE-2's dynamic tree, whose node budget is not a multiple of its depth; a hybrid's head's via
    `nodes_of`); None = learn it from the trees drafted (nodes per depth, 1 for chains)."""
    return _stated(drafter, source, "nodes")


def depth_limit(drafter: Any, source: str = "draft") -> int | None:
    """How deep `source` of `drafter` can draft at all (heads.types.Drafter's max_depth: DFlash's drafting slots,
    MTP's separate modules, Medusa's tree; a hybrid's head's via max_depth_of); None = no limit."""
    return _stated(drafter, source, "max_depth")


def measured_prior(stats: GenerationStats) -> list[float]:
    """Conditional acceptance per depth where it was measured, each depth pulled toward the one above it by a few
    judgments (eval.costs.shrunk_rates: a deep rate measured on a handful of passes is mostly chance), up to the
    first depth no pass tested.

    GenerationStats.acceptance_rates reports 0 for an untested depth, which as a prior would keep the policy
    from ever drafting that deep; here the list stops instead, and the policy repeats its last rate deeper
    (eval.speedup.extend_rates). Example: accepted [3, 1, 0], judged [4, 2, 0] -> [0.75, 0.667].
    """
    return shrunk_rates(stats.accepted_per_position, stats.judged_per_position)


def isotonic(verify: VerifyCost, weights: Mapping[int, float] | None = None) -> VerifyCost:
    """The nondecreasing least-squares fit of a measured T(n) (pool adjacent violators), each n weighted by
    `weights` (default 1: LearnedVerifyCost weights a size by how much was timed at it).

    A pass over more tokens never costs less, so a measured dip or spike is noise (a loaded machine); pooling
    it with its neighbours keeps a dip from buying longer drafts and a spike from pricing out every longer
    one. Example: T(1, 2, 4, 8) = 57, 90, 70, 200 ms -> 57, 80, 80, 200.
    """
    blocks: list[list[float]] = []  # [weighted sum, weight, sizes] of pooled neighbours, means nondecreasing
    ns = sorted(verify.seconds)
    for n in ns:
        w = 1.0 if weights is None else weights.get(n, 1.0)
        blocks.append([w * verify.seconds[n], w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight, sizes = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += sizes
    fitted = [b[0] / b[1] for b in blocks for _ in range(int(b[2]))]
    return VerifyCost(dict(zip(ns, fitted)), verify.context_len)


class LearnedVerifyCost:
    """T(n) = level * ratio(n): the shape from eval.costs' probe, refined by adjacent timed passes of different
    sizes, and the level (how fast the machine runs now) from every timed pass (see the module docstring).

    ratio(n) = T(n) / T(1): the probe's (its isotonic fit), blended with samples taken from two consecutive
    passes of different sizes (y_n / y_m * measured(m)), which ran a tenth of a second apart, so the machine's
    drift cancels in them. level = decayed mean of y / ratio(n) over the timed passes (in the eval plain
    decoding's too, timed beside the drafters': eval.turns). Why not a decayed mean per n: the machine drifts
    (a passage file's plain passes read 67-88 ms from turn to turn), so per-n means taken at different moments
    compare the moments, not the sizes. The tree passes of a fast spell read below T(1) from a slow one, the
    nondecreasing fit pooled T(4) with T(1), and the quickstart head drafted 3-node trees at a first-token
    acceptance of 0.17-0.20 where they cost 1.2x a plain pass (0.93x). Only the ratios matter to the policy's
    choice between sizes; the level prices drafting seconds against verifying seconds.

    One instance is shared by every request's policy in a run (the machine, not the request, sets the cost).
    Calling it gives the isotonic fit of level * ratio; `version` changes whenever an observation arrives.
    """

    def __init__(self, probe: VerifyCost, probe_weight: float = 4.0, decay: float = 0.9):
        if probe_weight <= 0 or not 0 < decay <= 1:
            raise ValueError("LearnedVerifyCost: need probe_weight > 0 and 0 < decay <= 1")
        self.probe, self.probe_weight, self.decay = probe, probe_weight, decay
        self.shape = isotonic(probe)
        self.samples: dict[int, list[float]] = {}  # n -> [decayed sum of T(n) / T(1) samples, decayed count]
        self.timed: list[float] | None = None  # [decayed sum of T(1)-equivalent seconds, decayed count]
        self._last: tuple[int, float] | None = None  # the previous timed pass (n, seconds), to pair with the next
        self.version = 0
        self._fit = self.shape
        self._probe_ratios: dict[int, float] = {}  # memo: the probe's shape never changes, and every pass reads it

    def _probe_ratio(self, n: int) -> float:
        r = self._probe_ratios.get(n)
        if r is None:
            r = self._probe_ratios[n] = self.shape(n) / self.shape(1)
        return r

    def ratio(self, n: int) -> float:
        """T(n) / T(1): the probe's, blended with the adjacent-pass samples (the probe counts probe_weight)."""
        total, count = self.samples.get(n, (0.0, 0.0))
        return (self.probe_weight * self._probe_ratio(n) + total) / (self.probe_weight + count)

    def measured(self, n: int) -> float:
        """T(n) / T(1) from the samples alone (the probe's where there are none): what a sample is chained
        through. Chaining through the blend would pull every larger size toward the probe once more per link
        (a probe that read a steep curve flat priced 7-token drafts at a third of their cost)."""
        if n == 1 or n not in self.samples:
            return self._probe_ratio(n)
        total, count = self.samples[n]
        return total / count

    def level(self) -> float:
        """T(1) now: the decayed mean of the timed passes' T(1)-equivalents (the probe's before any)."""
        return self.shape(1) if self.timed is None else self.timed[0] / self.timed[1]

    def observe(self, n: int, seconds: float) -> None:
        """One timed verify pass over n tokens (the root included)."""
        last, self._last = self._last, (n, seconds)
        if last is not None and last[0] != n and min(seconds, last[1]) > 0:
            m, before = last
            # the larger size gets the sample, through the smaller one's ratio (T(1)'s is 1 by definition)
            small, big, ys, yb = (m, n, before, seconds) if m < n else (n, m, seconds, before)
            total, count = self.samples.get(big, (0.0, 0.0))
            self.samples[big] = [self.decay * total + yb / ys * self.measured(small), self.decay * count + 1.0]
        unit = seconds / self.ratio(n)
        total, count = self.timed or (0.0, 0.0)
        self.timed = [self.decay * total + unit, self.decay * count + 1.0]
        # a size weighs what was timed at it: an untimed one's probe value must not pool a timed one down
        est = self.estimate()
        counts = {size: c for size, (_, c) in self.samples.items()} | {1: self.timed[1]}
        self._fit = isotonic(est, {size: self.probe_weight + counts.get(size, 0.0) for size in est.seconds})
        self.version += 1

    def estimate(self) -> VerifyCost:
        """level * ratio(n) per n (the probe's and every sampled size), before the nondecreasing fit."""
        level = self.level()
        return VerifyCost({n: level * self.ratio(n) for n in sorted(set(self.probe.seconds) | set(self.samples))},
                          self.probe.context_len)

    def __call__(self, n: int) -> float:
        return self._fit(n)


class AdaptivePolicy:
    """eval.decoder.DraftPolicy choosing per-proposer draft lengths from measured costs and running acceptance."""

    def __init__(self, verify: VerifyCost | LearnedVerifyCost, costs: Mapping[str, DraftCost], prior: Mapping[str, Sequence[float]],
                 k_max: int = 8, prior_weight: float = 2.0, decay: float = 0.95, probe_every: int = 8,
                 margin: float = 1.0, explore_z: float = 1.0):
        if set(costs) != set(prior) or not prior:
            raise ValueError(f"AdaptivePolicy: costs {sorted(costs)} and prior {sorted(prior)} must name the same proposers")
        if k_max < 1 or prior_weight <= 0 or not 0 < decay <= 1 or probe_every < 1 or margin < 1.0:
            raise ValueError("AdaptivePolicy: need k_max >= 1, prior_weight > 0, 0 < decay <= 1, probe_every >= 1, "
                             "margin >= 1")
        self.margin = margin  # a draft is chosen only when predicted faster than plain by this factor
        if explore_z < 0:
            raise ValueError("AdaptivePolicy: need explore_z >= 0")
        self.explore_z = explore_z  # standard deviations of optimism before a pass is left plain (explore)
        self.verify = verify if isinstance(verify, LearnedVerifyCost) else LearnedVerifyCost(verify)
        self.costs = dict(costs)
        self.prior = {s: extend_rates(a, k_max) for s, a in prior.items()}
        self.k_max, self.weight, self.decay, self.probe_every = k_max, prior_weight, decay, probe_every
        self._t: dict[int, float] = {}
        self._t_version = -1
        # per proposer, its drafter's own node count per length where it states one (node_count, set by choose)
        self.declared: dict[str, Callable[[int], int] | None] = {}
        self.reset(0)

    def reset(self, k: int) -> None:
        self.first = k
        # Per proposer, drafting seconds observed and priced (observe_drafting): decayed sums, starting as
        # prior_weight passes at the calibration's price (set on its first drafting pass: the request's unit).
        self._drafting: dict[str, list[float]] = {}
        self._priced: dict[str, float] = {}  # this pass's chosen drafts' prices (unscaled), until observe_drafting
        # Acceptance counts per key: a proposer's name, or the finer key its drafter prices a proposal as
        # (`proposal_key`: the n-gram's match order); `key` maps each proposer to its current proposal's key.
        self.accepted: dict[str, list[float]] = {s: [0.0] * self.k_max for s in self.prior}
        self.judged: dict[str, list[float]] = {s: [0.0] * self.k_max for s in self.prior}
        # Per proposer, undecayed: what this request measured per depth, for a run to pool (eval.turns)
        self.tally: dict[str, tuple[list[int], list[int]]] = {s: ([0] * self.k_max, [0] * self.k_max)
                                                              for s in self.prior}
        self.shared: dict[str, float] = {}  # per proposer: the share of its own draft a batched draft costs
        self.key = {s: s for s in self.prior}
        self.keys = {s: {s} for s in self.prior}  # every key each proposer's proposals were priced as
        self.idle = dict.fromkeys(self.prior, 0)
        self.gap = dict.fromkeys(self.prior, self.probe_every)  # plain passes before the next re-probe
        self.width = dict.fromkeys(self.prior, 1.0)  # draft nodes per depth (1 for chains)

    def rates(self, source: str, key: str | None = None) -> list[float]:
        """The current estimate a_s(d) for d = 1..k_max: of `source`'s current proposal (the key its drafter
        priced it as this pass), or of `key`; a key with no observations yet is the source's prior."""
        key = key or self.key[source]
        w, pr = self.weight, self.prior[source]
        if key not in self.accepted:
            return list(pr)
        return [(a + w * p) / (j + w) for a, j, p in zip(self.accepted[key], self.judged[key], pr)]

    def upper_rates(self, source: str) -> list[float]:
        """Per depth, the highest estimate over every key `source` was priced as (its prior included): a bound
        on what `choose` can price for it before the drafter says which key this pass's proposal has."""
        return [max(r) for r in zip(self.prior[source], *(self.rates(source, k) for k in self.keys[source]))]

    def draft_scale(self, source: str) -> float:
        """Observed over priced drafting seconds of `source` so far in this request (1.0 before it drafted):
        its draft costs are priced times this. The calibration times drafts made every pass; in a request the
        drafter's tree is also merged and committed, which the calibration did not see: on passage questions
        the quickstart head's drafting passes cost 6 ms more than priced (47.7 against 41.4 ms, the priced
        draft 2.4 ms), which turned a predicted 1.08x into a measured 0.97x. What a drafter spends catching up
        on passes it skipped (eval.drafters.DeferredSync: the prompt's begin, one commit of the joined path)
        is paid once and is not observed here (eval.decoder leaves it out): priced into every later draft it
        kept a request that had two early rejections from ever drafting again."""
        seen_priced = self._drafting.get(source)
        return 1.0 if seen_priced is None else seen_priced[0] / seen_priced[1]

    def observe_drafting(self, seconds: float) -> None:
        """The drafter's seconds in the pass just verified (eval.decoder: its draft, a deferred catch-up, its
        commit) against what `choose` priced that pass's drafts at; teaches `draft_scale` of the proposer
        priced highest in it (a hybrid's pass is mostly its head's time when the head drafted)."""
        priced, self._priced = self._priced, {}
        total = sum(priced.values())
        if total <= 0:  # a plain pass, or drafts priced at nothing: no scale to learn
            return
        owner = max(priced, key=priced.__getitem__)
        seen, was = self._drafting.setdefault(owner, [self.weight * total, self.weight * total])
        self._drafting[owner] = [self.decay * seen + seconds, self.decay * was + total]

    def use_draft_share(self, shared: Mapping[str, float]) -> None:
        """Price these proposers' drafts at this share of their own (eval.policy.LoadAware: a row of a batch whose
        head drafts the rows together pays its share of one batched head pass, not a pass of its own)."""
        self.shared = dict(shared)

    def _draft_cost(self, source: str, nodes: int) -> float:
        return self.costs[source](nodes) * self.draft_scale(source) * self.shared.get(source, 1.0) if nodes else 0.0

    def _nodes(self, source: str, length: int) -> int:
        if not length:
            return 0
        count = self.declared.get(source)
        return count(length) if count is not None else math.ceil(self.width[source] * length - 1e-9)

    def _verify(self, n: int) -> float:
        """T(n) of the isotonic fit, memoised (choose prices up to (k_max + 1)^2 candidates every pass)."""
        if self._t_version != self.verify.version:
            self._t, self._t_version = {}, self.verify.version
        t = self._t.get(n)
        if t is None:
            t = self._t[n] = self.verify(n)
        return t

    def predicted_speedup(self, lengths: Mapping[str, int], reach: Mapping[str, list[float]] | None = None) -> float:
        """E(l) * T(1) / time(l) for these per-proposer lengths (see the module docstring; eval.costs.speedup,
        whose choose_k this equals for one chain proposer drafting every pass).

        reach[s][d-1] = P_s(d) may be passed in when it is already computed (choose prices many l at once).
        """
        if max(lengths.values(), default=0) == 0:
            return 1.0
        e, draft_s, nodes = self.expected(lengths, reach)
        return speedup(e, draft_s + self._verify(1 + nodes), self._verify(1))

    def expected(self, lengths: Mapping[str, int],
                 reach: Mapping[str, list[float]] | None = None) -> tuple[float, float, int]:
        """(E(l) tokens, drafting seconds, draft nodes) of a pass drafting these per-proposer lengths."""
        depth = max(lengths.values(), default=0)
        if depth == 0:
            return 1.0, 0.0, 0
        if reach is None:
            reach = {s: list(itertools.accumulate(self.rates(s), lambda x, y: x * y)) for s in lengths}
        miss = [1.0] * depth  # P(no proposer's chain reaches depth d)
        for s, n in lengths.items():
            r = reach[s]
            for d in range(n):
                miss[d] *= 1.0 - r[d]
        e = 1.0 + depth - sum(miss)
        t, nodes = 0.0, 0
        for s, n in lengths.items():
            if n:
                m = self._nodes(s, n)
                t += self._draft_cost(s, m)
                nodes += m
        return e, t, nodes

    def use_verify(self, verify: Any) -> None:
        """Price passes with another verify curve from now on (eval.batch: the share of a batch pass at the
        batch's current size); anything with __call__(n) nondecreasing in n (best_lengths' bound relies on it),
        `version` and observe(n, seconds)."""
        self.verify, self._t_version = verify, -1

    def best_lengths(self, sources: Sequence[str], limit: Mapping[str, int]) -> dict[str, int]:
        """The lengths (each 0..limit[s]) with the highest predicted_speedup; ties go to the shorter. A draft has
        to beat plain decoding by `margin` (1.0: any predicted gain) or the pass is plain.

        One or two proposers, priced incrementally (O(1) per candidate, this runs every pass): adding depth
        d to the second proposer adds P(the first misses d) * P_2(d) to E.

        A bound is tried first: no candidate expects more tokens than the deepest one, and none costs less than
        the cheapest draft plus T(1 + the fewest nodes), the verify curve being nondecreasing (every curve
        the policy prices with is an isotonic fit: LearnedVerifyCost, ScaledCurve, RowShare). Where even that
        does not beat plain, no candidate can, and the pass is plain without pricing each one: most passes
        of a request where drafting is off, whose loop must cost what plain decoding's does. A never-drafting
        policy's choose and observe, timed alone, take about 21 us a pass with it against 33-38 us before; in
        the decoder's loop the gain is below what scripts/bench_batch.py resolves (docs/batching.md).
        """
        if not 1 <= len(sources) <= 2:
            raise ValueError(f"AdaptivePolicy: one or two proposers, got {list(sources)}")
        a, b = sources[0], (sources[1] if len(sources) == 2 else None)
        reach = {s: list(itertools.accumulate(self.rates(s), lambda x, y: x * y)) for s in sources}
        la_max, lb_max = limit[a], (limit[b] if b else 0)
        ra, rb = reach[a], (reach[b] if b else [])
        nodes_a = [self._nodes(a, n) for n in range(la_max + 1)]
        nodes_b = [self._nodes(b, n) for n in range(lb_max + 1)] if b else [0]
        cost_a = [self._draft_cost(a, m) for m in nodes_a]
        cost_b = [self._draft_cost(b, m) for m in nodes_b] if b else [0.0]
        t1 = self._verify(1)
        best, arg = self.margin, (0, 0)  # a plain pass unless some draft beats it by the margin
        if not la_max and not lb_max:
            return dict(zip(sources, arg))
        e_max = 1.0 + sum(ra[:la_max]) + sum((1.0 - ra[d] if d < la_max else 1.0) * rb[d] for d in range(lb_max))
        cheapest = min(cost_a[1:] + cost_b[1:]) + self._verify(1 + min(nodes_a[1:] + nodes_b[1:]))
        if speedup(e_max, cheapest, t1) <= best:  # <=, not the 1e-9 slack below: rounding cannot flip it
            return dict(zip(sources, arg))
        e_a = 1.0
        for la in range(la_max + 1):
            if la:
                e_a += ra[la - 1]
            e = e_a
            for lb in range(lb_max + 1):
                if lb:
                    d = lb - 1
                    e += (1.0 - ra[d] if d < la else 1.0) * rb[d]
                if la or lb:
                    speed = speedup(e, cost_a[la] + cost_b[lb] + self._verify(1 + nodes_a[la] + nodes_b[lb]), t1)
                    if speed > best * (1 + 1e-9):
                        best, arg = speed, (la, lb)
        return dict(zip(sources, arg))

    def optimistic_first_rate(self, source: str) -> float:
        """The first-depth estimate of `source`'s current proposal plus `explore_z` standard deviations of it (the
        Beta posterior's, whose pseudo-count is the decayed judgments plus the prior's weight), at most 1."""
        key = self.key[source]
        m = self.rates(source)[0]
        n = (self.judged[key][0] if key in self.judged else 0.0) + self.weight
        return min(1.0, m + self.explore_z * math.sqrt(m * (1.0 - m) / (n + 1.0)))

    def explore(self, sources: Sequence[str], limit: Mapping[str, int], candidates: Sequence[str]) -> dict[str, int]:
        """The lengths of a pass the estimates priced plain: one token of the proposer among `candidates` whose
        one-token draft is predicted fastest at its optimistic first-depth rate (`optimistic_first_rate`), if that
        beats plain by `margin`; else plain (the re-probes then take over: `choose`). `choose` makes the candidates
        the proposers whose proposal is not known before drafting (heads): a known one (the n-gram's match) is
        worth its deep positions, which one token never measures, so it keeps its whole-match re-probes (one-token
        explorations of the hybrid's n-gram cost the quickstart's hybrid 0.04-0.05x on mt_bench and humaneval).

        Why: the estimates are counts of a few dozen judgments. Two chance rejections early in a request pulled a
        head that goes on to accept 0.4 of its first tokens below the price of a draft, and the one-token
        re-probes, each as likely to fail, kept it plain for a whole gsm8k answer (120 passes) where drafting
        paid about 1.2x. A one-token draft costs at most the break-even rate of a pass, so trying one while the
        estimate is this uncertain is cheap, and a proposer rejected every time stops within a dozen passes
        (tests/test_policy.py). Simulated 128-token requests at the quickstart's costs: 0.4-0.6% slower where
        nothing is accepted, 4-7% faster at a first-token acceptance of 0.2-0.45 (docs/results.md)."""
        t1, best, pick = self._verify(1), self.margin, None
        for s in candidates:
            if limit[s]:
                nodes = self._nodes(s, 1)
                speed = speedup(1.0 + self.optimistic_first_rate(s),
                                self._draft_cost(s, nodes) + self._verify(1 + nodes), t1)
                if speed > best * (1 + 1e-9):
                    best, pick = speed, s
        return {s: int(s == pick) for s in sources}

    def choose(self, drafter: Any, budget: int) -> dict[str, int]:
        sources = list(getattr(drafter, "SOURCES", ("draft",)))
        if set(sources) != set(self.prior):
            raise ValueError(f"AdaptivePolicy: the drafter's proposers {sources} are not the policy's {sorted(self.prior)}")
        cap = max(min(budget, self.k_max), 0)
        limit, probe, unknown = {}, {}, []
        for s in sources:
            known = drafter.proposal(s, cap) if hasattr(drafter, "proposal") else None
            limit[s] = cap if known is None else min(known, cap)
            # a block of 3 slots priced as an 8-token draft would pay for depths it never drafts
            deepest = depth_limit(drafter, s)
            if deepest is not None:
                limit[s] = min(limit[s], deepest)
            # a drafter's own node count prices its trees exactly; a tree of n nodes reaches depth n at most
            count = self.declared[s] = node_count(drafter, s)
            if count is not None and limit[s]:
                limit[s] = min(limit[s], count(limit[s]))
            if known is None:
                unknown.append(s)
            self.key[s] = drafter.proposal_key(s) if hasattr(drafter, "proposal_key") else s
            self.keys[s].add(self.key[s])
            # A proposal known before drafting (the n-gram's match) costs nothing to draft and its worth is in
            # its deep positions, which a one-token probe would never measure: probe it whole.
            probe[s] = 1 if known is None else limit[s]
        if self.first:
            choice = {s: min(self.first, limit[s]) for s in sources}
            self.first = 0
        else:
            choice = self.best_lengths(sources, limit)
            if not any(choice.values()):
                choice = self.explore(sources, limit, unknown)
        for s in sources:
            if choice[s]:  # drafting on its own merits: probing starts over
                self.idle[s], self.gap[s] = 0, self.probe_every
            elif limit[s]:
                self.idle[s] += 1
                if self.idle[s] >= self.gap[s]:  # re-probe (one cheap draft token), then wait twice as long
                    choice[s], self.idle[s] = probe[s], 0
                    self.gap[s] = min(2 * self.gap[s], MAX_PROBE_GAP_FACTOR * self.probe_every)
        self._priced = {s: self.costs[s](self._nodes(s, n)) for s, n in choice.items() if n}
        return choice

    def observe(self, tree: DraftTree, accepted: list[int], seconds: float | None = None) -> None:
        n = len(tree)
        if seconds is not None:
            self.verify.observe(n + 1, seconds)
        if n == 0:
            return
        tags = [t.split("+") for t in tree.sources] if tree.sources is not None else [["draft"]] * n
        parents = tree.parents.tolist()
        depth = [0] * n
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        for s in self.prior:
            mine = [i for i in range(n) if s in tags[i]]
            if not mine:
                continue
            got = 0  # this proposer's nodes are ancestor-closed: its accepted part is a prefix of the path
            while got < len(accepted) and s in tags[accepted[got]]:
                got += 1
            last = accepted[got - 1] if got else -1
            tested = min(got + int(any(parents[i] == last for i in mine)), self.k_max)
            key = self.key[s]
            if key not in self.accepted:
                self.accepted[key], self.judged[key] = [0.0] * self.k_max, [0.0] * self.k_max
            acc, jud = self.accepted[key], self.judged[key]
            raw_acc, raw_jud = self.tally[s]
            for d in range(tested):
                jud[d] = self.decay * jud[d] + 1.0
                acc[d] = self.decay * acc[d] + float(d < got)
                raw_jud[d] += 1
                raw_acc[d] += int(d < got)
            self.width[s] = 0.5 * self.width[s] + 0.5 * len(mine) / max(depth[i] for i in mine)


class ScaledCurve:
    """T(B, n) for one batch size: the measured curve's shape (isotonic fit) times a load factor learned from
    the run's timed passes (decayed mean of observed / measured seconds, over every n observed).

    Why not LearnedVerifyCost here: in a batch most passes have one width (plain passes, once drafting is
    off), so a per-n blend would follow the machine's load at that width only while the other widths kept
    the probe's quieter (or busier) value, and the ratio the policy prices would drift with the load, not
    with the cost. A common factor keeps the measured ratios T(B, n) / T(B, 1) and follows the level.
    """

    def __init__(self, probe: VerifyCost, decay: float = 0.9, load: float | None = None):
        """load: a starting load factor worth one observed pass (LoadAware: the nearest timed batch size's)."""
        self.fit, self.decay = isotonic(probe), decay
        self.ratio, self.count = (0.0, 0.0) if load is None else (load, 1.0)
        self.version = 0

    @property
    def scale(self) -> float:
        return self.ratio / self.count if self.count else 1.0

    def observe(self, n: int, seconds: float) -> None:
        self.ratio = self.decay * self.ratio + seconds / max(self.fit(n), 1e-12)
        self.count = self.decay * self.count + 1.0
        self.version += 1

    def __call__(self, n: int) -> float:
        return self.fit(n) * self.scale


class RowShare:
    """One row's share of a batch pass at batch size `batch`: n -> T(batch, n) / batch at the surface's own level
    (the curve's shape, without its load factor). An AdaptivePolicy priced with it weighs a row's expected tokens
    against what its draft adds to the one pass every row shares (eval.batch). Its drafting seconds are the
    calibration's, timed beside the surface, so both sides are priced at the same load and a load factor cancels,
    as in LoadAware's score. With the factor on the pass only, a target that ran 50 times faster than its
    surface (a tiny model, or a quieter machine than the measurement's) made every draft look 50 times dearer
    than its pass, and the rows stopped drafting on a flat surface (tests/test_batch.py)."""

    def __init__(self, learned: ScaledCurve, batch: int):
        self.learned, self.batch = learned, batch

    @property
    def version(self) -> int:
        return self.learned.version

    def __call__(self, n: int) -> float:
        return self.learned.fit(n) / self.batch

    def observe(self, n: int, seconds: float) -> None:
        """A timed row share (seconds of the whole pass / batch) teaches the batch size's curve."""
        self.learned.observe(n, seconds * self.batch)


def _between(surface: Mapping[int, VerifyCost], batch: int) -> VerifyCost:
    """T(batch, n) for a batch size that was not measured: linear in the batch size between the measured
    neighbours (along the last segment beyond them; the smallest measured one below them)."""
    sizes = sorted(surface)
    if batch <= sizes[0] or len(sizes) == 1:
        return surface[sizes[0] if batch <= sizes[0] else sizes[-1]]
    lo, hi = sizes[-2], sizes[-1]
    for a, b in zip(sizes, sizes[1:]):
        if a < batch < b:
            lo, hi = a, b
    ns = sorted(set(surface[lo].seconds) | set(surface[hi].seconds))
    f = (batch - lo) / (hi - lo)
    seconds = {n: max(surface[lo](n) + f * (surface[hi](n) - surface[lo](n)), 1e-9) for n in ns}
    return VerifyCost(seconds, surface[lo].context_len)


def _nearest(sizes: Iterable[int], batch: int) -> int:
    """The batch size among `sizes` nearest to `batch`, the smaller one on a tie."""
    return min(sizes, key=lambda b: (abs(b - batch), b))


# The proposers LoadAware prices at a batch's draft share: a head drafter's own ("draft") and a hybrid's head; the
# n-gram's lookups are per row (and cost next to nothing).
SHARED_SOURCES = ("draft", "head")

# Passes at most left plain without pricing after pricings that ended plain (LoadAware's back-off): bounds the
# drafting chances it can miss (an n-gram match that appears meanwhile) to 7 passes.
MAX_BACKOFF = 7


class LoadAware:
    """Load-aware drafting for a batch (eval.batch): every row's AdaptivePolicy priced by its share of the
    batch pass, then a gate on the batch's throughput.

    surface: batch size -> T(B, n) (eval.costs.measure_cost_surface), each scaled by the load the run's own
    timed passes at that size show (ScaledCurve; an unmeasured size's shape is interpolated between the measured
    neighbours, an untimed size's factor starts at the nearest timed size's).
    Per pass, with B rows: row r's policy chooses its lengths against n -> T(B, n) / B (RowShare), which gives
    its expected tokens E_r, drafting seconds D_r and nodes n_r (AdaptivePolicy.expected). The pass is as wide
    as its widest row, so the gate keeps the drafts of the rows with n_r <= w for the w (0 or one of the n_r)
    maximising  sum_r E_r(w) / (L sum_r D_r(w) + T(B, 1 + w))  (a dropped row: E 1, D 0), and w = 0 (a plain
    pass, no drafter called) unless that beats plain decoding's B / T(B, 1) by `margin` (default 5%: the
    measured costs are noisy on a shared machine, and a predicted gain smaller than that noise is not worth
    risking a loss for). So drafting never buys a pass the cost surface says is slower than plain decoding,
    at any batch size. `gated` counts dropped drafts. L is the size's load factor (ScaledCurve.scale, observed
    over measured seconds of its passes): the drafters were timed at calibration beside the surface, so the
    machine's load slows them as much as the target. Left unscaled, a load factor raised by a run's first,
    slower passes made the target alone dearer, and a draft the surface priced 1% past the margin at batch 1
    went through and lost (docs/batching.md).

    Drafting seconds: a row's policy prices its head's draft (the proposers in `share_sources`) at its own
    calibrated cost times the batch's draft share (`share`: what one row's draft costs when the rows' drafts
    are made in one batched head pass, eval.costs.measure_draft_share, per batch size; 1.0 without one): on a
    GPU a head pass over 16 rows costs about one row's, and priced as 16 passes the gate would refuse drafts
    that pay.

    The model can be wrong where nothing it prices is measured: the heads' commits, the tree mask, Python
    bookkeeping per row; and the rows' acceptance estimates can be optimistic. So every
    drafting pass is also timed whole (`observe_cycle`: draft, verify, commits) and set against what the gate
    planned for it, in two parts whose product (`realised`) scales every later drafting score:
    - time: priced over observed seconds, per batch size (what the gate cannot price grows with the rows). One
      pass measures it to a few percent. A size not yet drafted at takes the nearest one's within a factor of
      1.5, else the largest smaller one's: a smaller batch's ratio bounds a larger one's from above, so a new
      size is priced no worse than it can be and drafts where the surface says it pays, which measures it.
    - tokens: emitted over expected, pooled over every size (acceptance is the rows', not the batch's) and
      decayed slowly (`token_decay`), since one pass's count is as noisy as acceptance itself (1 to k + 1 a row).
    A single ratio per size of realised over predicted tokens/s, an EMA of 0.7, was tried first: one pass moved
    it between 0.78 and 1.68 at batch 1, it ended one sweep's batch-1 runs at 0.85 although that size's passes
    delivered 1.00 of the prediction over 11 of them in another, and every larger size inherited the 0.85 and
    never drafted (docs/batching.md). A batch size where drafting delivers less than predicted stops drafting
    once its realised rate falls under plain's, whatever the surface says.
    """

    def __init__(self, surface: Mapping[int, VerifyCost], margin: float = 1.05, decay: float = 0.7,
                 token_decay: float = 0.95, draft_share: Mapping[int, float] | None = None,
                 share_sources: Iterable[str] = SHARED_SOURCES):
        if not surface or margin < 1.0 or not (0.0 <= decay < 1.0 and 0.0 <= token_decay < 1.0):
            raise ValueError("LoadAware: need a non-empty cost surface, margin >= 1 and decays in [0, 1)")
        if draft_share is not None and not all(b >= 1 and 0.0 < f <= 1.0 for b, f in draft_share.items()):
            raise ValueError(f"LoadAware: draft shares must be in (0, 1] per batch size >= 1, got {dict(draft_share)}")
        self.surface, self.margin, self.decay, self.token_decay = dict(surface), margin, decay, token_decay
        self.draft_share, self.share_sources = dict(draft_share or {}), tuple(share_sources)
        self.curves: dict[int, ScaledCurve] = {}
        self.gated = 0
        self._time: dict[int, tuple[float, float]] = {}  # batch -> decayed (priced, observed) drafting seconds
        self._tokens = (0.0, 0.0)  # decayed (emitted, expected) tokens of every drafting pass
        self._planned: tuple[int, float, float] | None = None  # the last drafting pass: (batch, expected
        # tokens, priced seconds at the surface's level: observe_cycle applies the load factor)
        self._backoff: dict[int, tuple[int, int]] = {}  # batch -> (passes left unpriced, plain pricings in a row)

    def realised(self, batch: int) -> float:
        """What this batch size's drafting passes deliver of the gate's prediction: the pooled token ratio times
        the size's time ratio (the class doc). 1.0 before any drafting pass."""
        emitted, expected = self._tokens
        return (emitted / expected if expected > 0 else 1.0) * self.time_ratio(batch)

    def time_ratio(self, batch: int) -> float:
        """Priced over observed seconds of this batch size's drafting passes; a size with none takes the nearest
        size's within a factor of 1.5 (rows that finish shrink a batch one size at a time), else the largest
        smaller size's (an upper bound: the class doc), else 1.0."""
        seen = [b for b, (_, observed) in self._time.items() if observed > 0]
        near = [b for b in seen if batch / 1.5 <= b <= batch * 1.5]
        below = [b for b in seen if b < batch]
        if near:
            priced, observed = self._time[_nearest(near, batch)]
        elif below:
            priced, observed = self._time[max(below)]
        else:
            return 1.0
        return priced / observed

    def observe_cycle(self, batch: int, tokens: int, seconds: float) -> None:
        """One whole pass (drafting, the verify forward, every row's commit) of `batch` rows that emitted
        `tokens`; only a pass the gate let draft teaches `realised`.

        Its price is the plan's surface-level seconds at the size's load factor as it stands now, this pass's
        own verify forward included (eval.batch observes that first), not as it stood when the gate priced it:
        the time ratio is for what the gate cannot price, and every later score applies the load factor again.
        Priced at the factor of the moment, a size's first drafting pass, priced before any pass at that size
        was timed (factor 1.0 against a machine at 1.45), left batch 2 a time ratio of 0.57 that its learned
        factor then counted a second time: batch 2 never drafted again, and batch 4 inherited it, where the
        fixed hybrid ran 1.41x and 1.04x (docs/batching.md)."""
        planned, self._planned = self._planned, None
        if planned is None or planned[0] != batch or seconds <= 0:
            return
        _, expected, surface_seconds = planned
        priced = surface_seconds * self.curve(batch).scale
        emitted, total = self._tokens
        self._tokens = (self.token_decay * emitted + tokens, self.token_decay * total + expected)
        p, o = self._time.get(batch, (0.0, 0.0))
        self._time[batch] = (self.decay * p + priced, self.decay * o + seconds)

    def curve(self, batch: int) -> ScaledCurve:
        """T(batch, n): the measured (or interpolated) shape at the load the run's passes show. A size not yet
        timed starts at the nearest timed size's load factor (the machine's load slows every size; the smaller
        one on a tie), worth one pass, so that its first pricing is not at the calibration's level."""
        if batch not in self.curves:
            timed = [b for b, c in self.curves.items() if c.count > 0]
            near = _nearest(timed, batch) if timed else None
            self.curves[batch] = ScaledCurve(self.surface.get(batch) or _between(self.surface, batch),
                                             load=self.curves[near].scale if near is not None else None)
        return self.curves[batch]

    def observe(self, batch: int, n: int, seconds: float) -> None:
        """One timed batch pass: `batch` rows of n tokens each (root, nodes, fillers)."""
        self.curve(batch).observe(n, seconds)

    def cannot_pay(self, rows: Sequence[tuple[Any, AdaptivePolicy]], budgets: Sequence[int]) -> bool:
        """True when no choice the rows' policies could make would pass the gate this pass, from an upper bound
        on every width's score: a row drafting at most w nodes reaches depth <= min(w, its cap), and at depth d
        adds at most min(1, sum_s P_s(d)) expected tokens (1 - prod_s (1 - P_s(d)) <= sum_s P_s(d)), while the
        pass costs at least T(B, 1 + w) (drafting time >= 0). So
            score(w) <= (B + sum_r G_r(min(w, cap_r))) / T(B, 1 + w),   G_r(m) = sum_{d <= m} min(1, sum_s P_s(d)),
        and when realised * that bound is not above plain's margin * B / T(B, 1) for any w up to the largest
        cap, the gate would drop every draft: `choose` then skips the per-row pricing (eval.policy's
        best_lengths over up to 81 candidates a row, the n-gram's lookups), which at batch 16 cost 6 ms of a
        150 ms pass on the 2-core CPU under cProfile, 2-3 ms without (docs/batching.md), and the pass is plain."""
        b = len(rows)
        curve, realised = self.curve(b), self.realised(b)
        best = self.margin * b / curve(1)
        caps = [max(min(budget, policy.k_max), 0) for (_, policy), budget in zip(rows, budgets)]
        top = max(caps, default=0)
        gain = [0.0] * (top + 1)  # gain[m] = sum over rows of G_r(min(m, cap_r))
        for (_, policy), cap in zip(rows, caps):
            per_depth = [0.0] * cap
            for s in policy.prior:
                for d, reach in enumerate(itertools.accumulate(policy.upper_rates(s)[:cap], lambda x, y: x * y)):
                    per_depth[d] += reach
            g = list(itertools.accumulate(min(1.0, x) for x in per_depth))
            for m in range(1, top + 1):
                gain[m] += g[min(m, cap) - 1] if cap else 0.0
        return all(realised * (b + gain[w]) / curve(1 + w) <= best * (1 + 1e-9) for w in range(1, top + 1))

    def choose(self, rows: Sequence[tuple[Any, AdaptivePolicy]], budgets: Sequence[int]) -> list[dict[str, int]]:
        """This pass's lengths per row (rows: (drafter, policy) pairs; budgets: each row's draft cap). When
        `cannot_pay`, every row gets zeros and no policy is consulted (its re-probe counters wait too)."""
        b = len(rows)
        curve = self.curve(b)
        self._planned = None
        left, streak = self._backoff.get(b, (0, 0))
        if left:  # backing off after passes the bound or the pricing made plain (`_back_off`)
            self._backoff[b] = (left - 1, streak)
            return [dict.fromkeys(getattr(drafter, "SOURCES", ("draft",)), 0) for drafter, _ in rows]
        if self.cannot_pay(rows, budgets):
            self._back_off(b, streak)
            return [dict.fromkeys(getattr(drafter, "SOURCES", ("draft",)), 0) for drafter, _ in rows]
        share = RowShare(curve, b)
        drafts = dict.fromkeys(self.share_sources, self.share(b))
        choices, plans = [], []
        for (drafter, policy), budget in zip(rows, budgets):
            policy.use_verify(share)
            policy.use_draft_share(drafts)
            c = policy.choose(drafter, budget)
            choices.append(c)
            plans.append(policy.expected(c))
        best_w, best = 0, self.margin * b / curve(1)
        realised, planned = self.realised(b), (0.0, 0.0)
        for w in sorted({n for _, _, n in plans if n}):
            kept = [p for p in plans if p[2] <= w]
            e = sum(p[0] for p in kept) + (b - len(kept))
            # drafting and the pass at the surface's level, both slowed by the load factor (the class doc)
            at_surface = sum(p[1] for p in kept) + curve.fit(1 + w)
            score = e / (curve.scale * at_surface)
            if realised * score > best * (1 + 1e-9):
                best_w, best, planned = w, realised * score, (e, at_surface)
        for i, (_, _, n) in enumerate(plans):
            if n > best_w:
                choices[i] = dict.fromkeys(choices[i], 0)
                self.gated += 1
        self._planned = (b, *planned) if best_w else None
        if best_w:
            self._backoff[b] = (0, 0)
        else:
            self._back_off(b, streak)
        return choices

    def share(self, batch: int) -> float:
        """The share of a row's own drafting seconds its head's draft costs in a batch of `batch` rows (drafted
        together: eval.batch), from `draft_share` measured per batch size (eval.costs.measure_draft_share): the
        largest measured size not above `batch` (a larger batch shares at least as well), 1.0 below them all."""
        sizes = [s for s in self.draft_share if s <= batch]
        return self.draft_share[max(sizes)] if sizes else 1.0

    def _back_off(self, b: int, streak: int) -> None:
        """After a pass its bound or pricing made plain (likely again: a row learns nothing from a plain pass),
        leave the next 1, 3, 7, 7, ... passes at batch size b unpriced; a drafting pass resets it."""
        self._backoff[b] = (min(2 ** (streak + 1) - 1, MAX_BACKOFF), streak + 1)
