"""The speedup model: predict speculative speedup for each draft length k from measured quantities only.

Inputs, all measured in the same eval run:
  a_i     effective acceptance at draft position i (1-based): P(a token at position i is accepted | drafts
          1..i-1 were accepted) = accepted[i] / accepted[i-1] (accepted[0] = all target passes). A pass whose
          drafter proposed nothing at position i (prompt lookup without a match, a chain cut short) counts
          as a rejection there, so E(k) at the k that ran reproduces the measured tau exactly.
  T(n)    seconds of one target pass over n new tokens (the verify cost curve; on small CPUs it grows
          with n, on a GPU at batch 1 it is nearly flat). A plain decode step is T(1).
  d       seconds of one draft step; c = d / T(1) is the cost ratio of SCIENCE.md.

For a chain of k drafts, one target pass verifies k+1 tokens (the root and k drafts) and emits
  E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k         tokens (tau: counting the corrected/bonus token)
in time k*d + T(k+1), against E(k) plain steps costing E(k)*T(1). So
  speedup(k) = E(k) * T(1) / (k*d + T(k+1)),
which with a flat verify cost (T(k+1) = T(1)) and a constant a is SCIENCE.md's
  (1 - a^(k+1)) / (1 - a) / (k*c + 1).
Positions deeper than the run measured reuse the deepest measured rate (stated in the report). A tree
with N nodes and depth D verifies N+1 tokens after D draft steps; its E is the measured tau.

    python -m eval.speedup --alpha 0.5 --c 0.2          # the flat-cost formula for k = 1..8
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any


def effective_acceptance(accepted: Sequence[int], passes: int) -> list[float | None]:
    """a_i = accepted[i] / accepted[i-1] per draft position, accepted[-1] taken as `passes`.

    accepted[i] = passes whose draft token at position i+1 was accepted (eval.decoder's
    GenerationStats.accepted_per_position). None where no pass got that far (the rate is unmeasured).
    Example: 10 passes; 6 accepted position 1, 3 of those also position 2: accepted [6, 3] -> [0.6, 0.5],
    and 1 + 0.6 + 0.6*0.5 = 1.9 = (10 + 6 + 3) / 10, the measured tau.
    """
    out: list[float | None] = []
    prev = passes
    for i, a in enumerate(accepted):
        if a < 0 or a > prev:
            raise ValueError(f"position {i + 1}: {a} accepted but only {prev} passes reached it")
        out.append(a / prev if prev > 0 else None)
        prev = a
    return out


def _rates(cond: Sequence[float | None], k: int) -> list[float]:
    """k conditional rates: measured ones in order, the deepest measured rate repeated beyond them.

    Example: cond [0.8, 0.6, None], k 4 -> [0.8, 0.6, 0.6, 0.6] (None: never reached, treated as unmeasured).
    """
    measured = []
    for a in cond:
        if a is None:
            break
        measured.append(float(a))
    if not measured:
        return [0.0] * k
    return (measured + [measured[-1]] * k)[:k]


def expected_tokens(cond: Sequence[float | None], k: int) -> float:
    """E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k: tokens per target pass, counting the bonus token."""
    total, run = 1.0, 1.0
    for a in _rates(cond, k):
        run *= a
        total += run
    return total


def verify_cost(curve: Mapping[int, float], n: int) -> float:
    """T(n) from a measured curve {tokens in pass: seconds}, linear between points, linear beyond the ends.

    Example: {1: 0.05, 5: 0.09} -> T(3) = 0.07, T(9) = 0.13 (slope 0.01 per token past the last point).
    """
    if not curve:
        raise ValueError("empty verify cost curve")
    pts = sorted((int(x), float(y)) for x, y in curve.items())
    if n in dict(pts):
        return dict(pts)[n]
    if len(pts) == 1:
        return pts[0][1]
    if n < pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif n > pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        i = next(j for j in range(1, len(pts)) if pts[j][0] >= n)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0)


def predicted_speedup(
    cond: Sequence[float | None], k: int, draft_cost: float, curve: Mapping[int, float]
) -> float:
    """E(k) * T(1) / (k*d + T(k+1)) (see the module docstring)."""
    plain = verify_cost(curve, 1)
    return expected_tokens(cond, k) * plain / (k * draft_cost + verify_cost(curve, k + 1))


def flat_speedup(alpha: float, k: int, c: float) -> float:
    """SCIENCE.md's closed form with a flat verify cost: (1 - a^(k+1)) / (1 - a) / (k*c + 1)."""
    e = float(k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return e / (k * c + 1)


def speedup_model(
    cond: Sequence[float | None],
    draft_cost: float,
    curve: Mapping[int, float],
    ks: Sequence[int] = tuple(range(1, 9)),
    measured: Mapping[str, Any] | None = None,
    trees: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The report's `speedup_model` section.

    measured: what the run did ({"k", "tau", "speedup"}, plus "nodes"/"depth" for a tree); its predicted
    tau and speedup are put next to it. trees: [{"nodes", "depth", "tau"}] tree shapes to predict with
    their own measured tau (a tree's E is not a function of the chain rates).
    Returns {"c", "draft_cost_s", "verify_cost_s", "effective_acceptance", "predicted" {k: speedup},
    "predicted_tau" {k: tau}, "best_k", "trees", "measured"}; JSON keys are strings.
    """
    if not ks:
        raise ValueError("speedup model needs at least one k")
    plain = verify_cost(curve, 1)
    predicted = {str(k): predicted_speedup(cond, k, draft_cost, curve) for k in ks}
    best = max(ks, key=lambda k: predicted[str(k)])
    out: dict[str, Any] = {
        "c": draft_cost / plain if plain > 0 else None,
        "draft_cost_s": draft_cost,
        "verify_cost_s": {str(n): verify_cost(curve, n) for n in sorted({1, *(k + 1 for k in ks)})},
        "effective_acceptance": list(cond),
        "predicted": predicted,
        "predicted_tau": {str(k): expected_tokens(cond, k) for k in ks},
        "best_k": best,
        "best_predicted_speedup": predicted[str(best)],
        "trees": [
            {**t, "predicted": t["tau"] * plain / (t["depth"] * draft_cost + verify_cost(curve, t["nodes"] + 1))}
            for t in trees
        ],
    }
    if measured is not None:
        m = dict(measured)
        if m.get("nodes") is not None:
            m["predicted_tau"] = m["tau"]
            m["predicted_speedup"] = m["tau"] * plain / (m["depth"] * draft_cost + verify_cost(curve, m["nodes"] + 1))
        else:
            m["predicted_tau"] = expected_tokens(cond, int(m["k"]))
            m["predicted_speedup"] = predicted_speedup(cond, int(m["k"]), draft_cost, curve)
        out["measured"] = m
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the flat-verify-cost speedup formula for k = 1..K.")
    parser.add_argument("--alpha", type=float, required=True, help="acceptance rate per draft position")
    parser.add_argument("--c", type=float, required=True, help="draft step cost / target pass cost")
    parser.add_argument("--max-k", type=int, default=8)
    args = parser.parse_args(argv)
    print(f"alpha {args.alpha}, c {args.c}, flat verify cost")
    print("k  tau    speedup")
    for k in range(1, args.max_k + 1):
        print(f"{k:<2} {expected_tokens([args.alpha], k):.3f}  {flat_speedup(args.alpha, k, args.c):.3f}x")


if __name__ == "__main__":
    main()
