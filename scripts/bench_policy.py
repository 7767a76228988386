"""Simulate the adaptive drafting policy on synthetic requests: what its exploration costs and buys, per acceptance.

    python scripts/bench_policy.py                                       # the quickstart's measured costs
    python scripts/bench_policy.py --verify-ms 52.7,61.3,65.3 --draft-ms 2.0,1.0 --prior 0.45,0.5 --json out.json

No model runs: each request is `--tokens` new tokens of a chain proposer whose every drafted token is accepted with
probability alpha (independently, so a chain's accepted length is geometric), priced by eval.policy.AdaptivePolicy
with the given costs, its prior and the eval's single-stream margin (eval.turns.SINGLE_STREAM_MARGIN), as a head
alone is priced in eval.run, except that the verify curve and the draft cost stay as given (eval.run's learn from
its timed passes) and the prior is not pooled over earlier requests. A pass drafting k tokens costs
draft(k) + T(k + 1); plain decoding costs T(1) a token. For each alpha and each `--explore-z` (0 = no
exploration: the policy before `AdaptivePolicy.explore`), the table gives the speedup over plain decoding summed
over `--requests` seeded requests (the same acceptance draws for every z) and the share of passes that drafted.
Verify costs: T(1), T(2), T(3), ... ms (`--verify-ms`, the eval report's `costs.verify_s`); the draft cost: fixed
and per-token ms (`costs.draft_cost`).
JSON: {"<z>": {"<alpha>": {"speedup": x, "drafted": share}}}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from data.cli import UserError, cli_main, number_arg  # noqa: E402
from eval.costs import DraftCost, VerifyCost  # noqa: E402
from eval.policy import AdaptivePolicy  # noqa: E402
from eval.turns import SINGLE_STREAM_MARGIN  # noqa: E402
from heads.types import DraftTree  # noqa: E402


def simulate(verify: VerifyCost, draft: DraftCost, prior: list[float], alpha: float, explore_z: float,
             requests: int, tokens: int) -> tuple[float, float]:
    """(speedup over plain decoding, share of passes drafted) of `requests` synthetic requests (seeds 0..)."""
    spent = plain = 0.0
    passes = drafted = 0
    for seed in range(requests):
        rng = random.Random(seed)
        policy = AdaptivePolicy(verify, {"draft": draft}, {"draft": prior}, margin=SINGLE_STREAM_MARGIN,
                                explore_z=explore_z)
        policy.reset(1)  # the eval's first pass drafts its calibrated k; 1 here
        out = 0
        while out < tokens:
            k = policy.choose(object(), tokens - out - 1)["draft"]
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            spent += (draft(k) if k else 0.0) + verify(k + 1)
            if k:
                policy.observe(DraftTree.chain(torch.arange(k)), list(range(accepted)))
                policy.observe_drafting(draft(k))
                drafted += 1
            passes += 1
            out += accepted + 1
        plain += out * verify(1)
    return plain / spent, drafted / passes


@cli_main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verify-ms", type=number_arg("--verify-ms", float, 1e-6, many=True),
                    default=[35.5, 36.0, 38.0, 50.5, 52.8], help="T(1), T(2), ... in ms (default: the quickstart "
                    "eval's, 2026-12-06)")
    ap.add_argument("--draft-ms", type=number_arg("--draft-ms", float, 0.0, many=True), default=[2.3, 0.9],
                    help="the draft cost: fixed ms a drafting pass, ms per drafted token (default 2.3,0.9)")
    ap.add_argument("--prior", type=number_arg("--prior", float, 0.0, many=True), default=[0.27, 0.35],
                    help="the prior's acceptance per depth (default 0.27,0.35: the block drafter's calibration)")
    ap.add_argument("--alphas", type=number_arg("--alphas", float, 0.0, many=True),
                    default=[0.0, 0.1, 0.2, 0.3, 0.45], help="per-token acceptance of the simulated requests")
    ap.add_argument("--explore-z", type=number_arg("--explore-z", float, 0.0, many=True), default=[0.0, 1.0],
                    help="AdaptivePolicy explore_z values to compare (default 0,1)")
    ap.add_argument("--requests", type=number_arg("--requests"), default=200, help="requests per cell")
    ap.add_argument("--tokens", type=number_arg("--tokens"), default=128, help="new tokens a request")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if len(args.draft_ms) != 2:
        raise UserError(f"--draft-ms: expected two numbers (fixed, per token), got {args.draft_ms}")
    if any(a > 1 for a in args.alphas + args.prior):
        raise UserError("--alphas / --prior: acceptances must be at most 1")
    verify = VerifyCost({n + 1: ms / 1000 for n, ms in enumerate(args.verify_ms)}, 64)
    draft = DraftCost(args.draft_ms[0] / 1000, args.draft_ms[1] / 1000)
    out: dict[str, dict[str, dict[str, float]]] = {}
    print("| explore_z | " + " | ".join(f"alpha {a:g}" for a in args.alphas) + " |")
    print("|---|" + "---|" * len(args.alphas))
    for z in args.explore_z:
        row = out[f"{z:g}"] = {}
        cells = []
        for a in args.alphas:
            speed, share = simulate(verify, draft, args.prior, a, z, args.requests, args.tokens)
            row[f"{a:g}"] = {"speedup": speed, "drafted": share}
            cells.append(f"{speed:.3f}x ({share:.0%} drafted)")
        print(f"| {z:g} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
