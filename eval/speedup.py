"""The speedup model of the eval report: predicted speedup for each draft length k, best k, predicted vs measured.

The cost model itself lives in eval.costs (one model for choosing k and for the report):
    E(k)    = 1 + f * sum_{j<=k} prod_{i<=j} a_i     tokens per target pass, counting the bonus token (tau)
    time(k) = D(k) + f * T(k+1) + (1 - f) * T(1)     D = draft cost per pass, T(n) = verify cost of n tokens
    speedup = E(k) * T(1) / time(k)
with a_i the conditional acceptance at draft position i, f the share of passes that draft at all, T the
measured verify curve (it grows with n on CPUs) and D(k) = fixed + k * per_token (per_token / T(1) is
docs/science.md's c). This module turns one run's measurements into the report's `speedup_model` section:
acceptance measured only up to the k that ran is extended to deeper positions with the deepest measured
rate (a stated assumption, the flat-alpha approximation docs/science.md reports to be within ~1% for tau).

    python -m eval.speedup --alpha 0.5 --c 0.2          # docs/science.md's closed form for k = 1..8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from data.cli import cli_main
from eval.costs import DraftCost, VerifyCost, expected_tokens, predicted_speedup, predicted_tree_speedup


def extend_rates(rates: Sequence[float], k: int) -> list[float]:
    """The first k acceptance rates, the deepest measured one repeated past the measured positions.

    Example: [0.8, 0.6], k 4 -> [0.8, 0.6, 0.6, 0.6]; [] -> [0.0] * k (nothing measured: nothing accepted).
    """
    rates = [float(a) for a in rates]
    if not rates:
        return [0.0] * k
    return (rates + [rates[-1]] * k)[:k]


def flat_speedup(alpha: float, k: int, c: float) -> float:
    """docs/science.md's closed form, (1 - a^(k+1)) / (1 - a) / (k*c + 1): the cost model with a flat verify cost
    T = 1, a flat acceptance a and a draft cost of c per token."""
    return predicted_speedup([alpha] * k, k, VerifyCost({1: 1.0}, 0), DraftCost(0.0, c))


def speedup_model(
    acceptance: Sequence[float],
    draft_rate: float,
    verify: VerifyCost,
    draft: DraftCost,
    ks: Sequence[int] = tuple(range(1, 9)),
    measured: dict[str, Any] | None = None,
    tree_nodes: int | None = None,
) -> dict[str, Any]:
    """The report's `speedup_model` section (JSON keys are strings).

    acceptance: conditional acceptance per position as measured (extended with `extend_rates`).
    measured: what ran, {"k", "tau", "speedup"} (decode speedup); its predicted tau and speedup are added.
    tree_nodes: for a tree run, its (mean) node count; the tree's measured tau is priced by the cost model
    (acceptance is not recorded per node, so the prediction checks the costs, not E).
    Returns {"c", "draft_cost", "verify_cost_s", "acceptance_used", "draft_rate", "predicted" {k: speedup},
    "predicted_tau" {k: tau}, "best_k", "best_predicted_speedup", "measured", "tree"}.
    """
    if not ks:
        raise ValueError("speedup model needs at least one k")
    kmax = max(ks)
    rates = extend_rates(acceptance, kmax)
    predicted = {str(k): predicted_speedup(rates, k, verify, draft, draft_rate) for k in ks}
    best = max(ks, key=lambda k: predicted[str(k)])
    t1 = verify(1)
    out: dict[str, Any] = {
        "c": draft.per_token_s / t1 if t1 > 0 else None,
        "draft_cost": {"fixed_s": draft.fixed_s, "per_token_s": draft.per_token_s},
        "verify_cost_s": {str(n): verify(n) for n in sorted({1, *(k + 1 for k in ks)})},
        "acceptance_measured": [float(a) for a in acceptance],
        "acceptance_used": rates,
        "draft_rate": draft_rate,
        "predicted": predicted,
        "predicted_tau": {str(k): expected_tokens(rates, k, draft_rate) for k in ks},
        "best_k": best,
        "best_predicted_speedup": predicted[str(best)],
    }
    if measured is not None:
        m = dict(measured)
        k = int(m["k"])
        m["predicted_tau"] = expected_tokens(extend_rates(acceptance, k), k, draft_rate)
        m["predicted_speedup"] = predicted_speedup(extend_rates(acceptance, k), k, verify, draft, draft_rate)
        out["measured"] = m
    if tree_nodes is not None and measured is not None and tree_nodes > 0:
        # n equal node probabilities summing to tau - 1 give E = tau exactly in predicted_tree_speedup.
        probs = [(float(measured["tau"]) - 1.0) / tree_nodes] * tree_nodes
        out["tree"] = {"nodes": tree_nodes, "depth": int(measured["k"]), "tau": float(measured["tau"]),
                       "predicted_speedup": predicted_tree_speedup(probs, verify, draft)}
    return out


@cli_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print docs/science.md's flat-verify-cost speedup formula for k = 1..K.")
    parser.add_argument("--alpha", type=float, required=True, help="acceptance rate per draft position")
    parser.add_argument("--c", type=float, required=True, help="draft step cost / target pass cost")
    parser.add_argument("--max-k", type=int, default=8)
    args = parser.parse_args(argv)
    print(f"alpha {args.alpha}, c {args.c}, flat verify cost")
    print("k  tau    speedup")
    for k in range(1, args.max_k + 1):
        print(f"{k:<2} {expected_tokens([args.alpha] * k, k):.3f}  {flat_speedup(args.alpha, k, args.c):.3f}x")


if __name__ == "__main__":
    main()
