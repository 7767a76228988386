"""The eval's cost stage: the verify curve T(n), the off-benchmark calibrations, and the draft lengths and tree
shape they choose.

    costs, subject = measure_costs(target, subject, cfg.eval, questions)   # Costs: verify, cal, k, tree, ...
    report["costs"] = costs.section()

eval.tree "auto" for a family with EAGLE-2's dynamic tree (and k chosen here, not fixed by eval.num_draft_tokens):
the verify curve says how many draft nodes a pass verifies for about the price of none (`free_nodes`); where
that is two or more, a dynamic tree of that many nodes is calibrated beside the chain and drafted when it
predicts the higher speedup (`choose_tree`). A GPU's curve is flat past EAGLE-2's 60 nodes; the AVX2 EPYC's
with skinny kernels to about 3 (docs/results.md, "Small dynamic trees"); a curve that rises from the first
extra row keeps chains.

k and the adaptive policy's prior are measured on data/bundled/calibration_prompts.jsonl (in no benchmark and
in no bundled training data), never on the test questions; the cost model itself is eval.costs'. Called by
eval.run.evaluate (python -m eval.run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from data.config import EvalConfig
from data.readers import read_records
from eval.bench import Question
from eval.costs import Calibration, VerifyCost, calibrate, choose_k, ideal_speedup, measure_verify_cost
from eval.drafters import NgramDrafter
from eval.policy import depth_limit, isotonic
from eval.turns import prompt_ids

if TYPE_CHECKING:
    from eval.turns import Subject, Target

VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32, 64)  # tokens per target pass measured for T(n)
# k and the policy's prior are measured on prompts that are in no benchmark and in no training data this project
# bundles: four requests written for it (an explanation, an email, a function, a question over a given text).
# It used to be the first two GSM8K train questions, which the quickstart's mix trains the head on: its
# calibration then measured how well the head recalls answers it was trained on (a deep prior of 0.54 / 0.67 /
# 1.0), and the adaptive policy drafted deep on requests where no second draft token was ever accepted.
CALIBRATION_FILE = Path(__file__).resolve().parent.parent / "data" / "bundled" / "calibration_prompts.jsonl"
# A draft node is "free" while the pass verifying it costs at most this much over T(1). Measured pass-to-pass
# spread on the 2-core VMs is a few percent; the tree's branches added 0.15-0.25 tokens per pass to the
# quickstart head's 1.4-1.9 (10-15%), so a node costing more than 10% is no longer clearly paid for, and the
# calibration (choose_tree) decides within it anyway.
FREE_NODE_TOLERANCE = 0.10


def calibration_prompts(tok: Any, device: torch.device) -> list[torch.Tensor]:
    """The first user turn of every calibration prompt, chat-templated."""
    records, _ = read_records(CALIBRATION_FILE)
    return [prompt_ids(tok, [next(m for m in r.messages if m["role"] == "user")], device) for r in records]


@dataclass
class Costs:
    """What the cost stage measured and chose: the verify curve, both calibrations, the draft lengths."""

    verify: VerifyCost
    cal: Calibration  # the drafter under evaluation, at k = 8
    cal_ng: Calibration  # the n-gram's (the same one when the n-gram is the drafter under evaluation)
    best_k: int  # choose_k's draft length for the drafter (0: plain decoding predicted fastest)
    best_speedup: float  # and the speedup it predicts
    ngram_best_k: int  # choose_k's draft length for the n-gram, at least 1
    k: int  # the draft length the eval runs: eval.num_draft_tokens, else max(best_k, 1)
    k_ng: int  # the n-gram baseline's (k itself when the n-gram is the drafter under evaluation)
    # the tree drafted: eval.tree as configured, or what "auto" became (choose_tree); report.json's costs.tree
    tree: dict[str, Any]

    def tree_text(self) -> str:
        """The tree in words for the plan line: "chain", "dynamic (top-3, 3 nodes; chosen by eval.tree auto)"."""
        t = self.tree
        size = f"top-{t['topk']}, {t['tokens']} nodes" if t["used"] == "dynamic" else ""
        why = "chosen by eval.tree auto" if t["configured"] == "auto" and "free_nodes" in t else ""
        return t["used"] + (f" ({'; '.join(x for x in (size, why) if x)})" if size or why else "")

    def section(self) -> dict[str, Any]:
        """report.json's `costs`."""
        cal, cal_ng = self.cal, self.cal_ng
        return {
            "verify_s": {str(n): v for n, v in self.verify.seconds.items()},
            "verify_context_tokens": self.verify.context_len,
            "draft_cost": {"fixed_s": cal.draft_cost.fixed_s, "per_token_s": cal.draft_cost.per_token_s},
            # acceptance: eval.costs.shrunk_rates of the counts (judged = passes that tested a node there)
            "calibration": {"prompts": str(CALIBRATION_FILE.name), "acceptance_per_position": cal.acceptance,
                            "judged_per_position": cal.stats.judged_per_position,
                            "draft_rate": cal.draft_rate, "chosen_k": self.best_k,
                            "predicted_speedup": self.best_speedup},
            "ngram_calibration": {"acceptance_per_position": cal_ng.acceptance,
                                  "judged_per_position": cal_ng.stats.judged_per_position,
                                  "draft_rate": cal_ng.draft_rate,
                                  "draft_cost": {"fixed_s": cal_ng.draft_cost.fixed_s,
                                                 "per_token_s": cal_ng.draft_cost.per_token_s},
                                  "chosen_k": self.ngram_best_k},
            "tree": self.tree,
        }


def calibrate_drafter(target: Target, subject: Subject, prompts: list[torch.Tensor],
                      verify: VerifyCost) -> tuple[Calibration, int, float]:
    """The evaluated drafter's calibration at k = 8, and the draft length (0 = plain) and speedup it predicts, at
    most the drafter's own max_depth (a DFlash block of 3 drafting slots is never priced as a deeper chain)."""
    drafter = subject.factory(8)()
    k_max = min(8, depth_limit(drafter) or 8)
    cal = calibrate(target.model, drafter, prompts, k=8, max_new_tokens=32, eos_token_id=target.eos)
    best_k, best_speedup = choose_k(cal.acceptance, verify, cal.draft_cost, k_max=k_max, draft_rate=cal.draft_rate)
    if best_k > 0 and max(cal.stats.nodes_per_pass, default=0) > 8:
        # A tree verifies more nodes than its depth, which choose_k (a chain model) does not price: re-run the
        # calibration at the chosen depth and price its real node counts; plain decoding wins if it is faster.
        check = calibrate(target.model, subject.factory(best_k)(), prompts, k=best_k, max_new_tokens=32,
                          eos_token_id=target.eos)
        best_speedup = ideal_speedup(check.stats, verify, check.draft_cost)
        if best_speedup < 1.0:
            best_k, best_speedup = 0, 1.0
    return cal, best_k, best_speedup


def free_nodes(verify: VerifyCost, cap: int, tolerance: float = FREE_NODE_TOLERANCE) -> int:
    """The most draft nodes n <= cap such that verifying them, and any fewer, costs T(n + 1) <= (1 + tolerance)
    T(1) on the monotone fit of the curve (eval.policy.isotonic: a dip from noise cannot open a gap). 0: the
    first drafted node already costs more (a 2-core Xeon's SmolLM2 pass: T(2) = 1.2 T(1))."""
    fit = isotonic(verify)
    n = 0
    while n < cap and fit(n + 2) <= (1.0 + tolerance) * fit(1):
        n += 1
    return n


def choose_tree(target: Target, subject: Subject, cfg_eval: EvalConfig, prompts: list[torch.Tensor],
                verify: VerifyCost, chain: tuple[Calibration, int, float],
                log: Callable[[str], None] = print) -> tuple[Subject, tuple[Calibration, int, float], dict[str, Any]]:
    """eval.tree "auto" resolved: a dynamic tree of w nodes (at most eval.tree_tokens, each node's children at
    most eval.tree_topk) when w >= 2 and its calibration, priced by the measured curve and draft cost with every
    pass drafting the whole tree (ideal_speedup), beats the chain's predicted speedup (at its best k; 1.0 when
    plain decoding is predicted fastest); else the chain. w is the larger of free_nodes(...) and the chain's best
    k: a tree of the chain's k nodes verifies the same k + 1 rows the chain was found to pay for, and EAGLE-2's
    tree spends them on the head's likeliest paths, the chain's among them (on the AMD EPYC the curve took one
    free node, T(4) = 1.15 T(1), and the chain drafted 3: a 3-node tree was never tried). Returns the subject
    drafting it, its calibration (calibrate_drafter's triple) and report.json's costs.tree."""
    assert subject.sized is not None  # measure_costs asks only a subject that has sized trees
    free = free_nodes(verify, cfg_eval.tree_tokens)
    w = max(free, min(chain[1], cfg_eval.tree_tokens))
    record: dict[str, Any] = {"configured": "auto", "used": "chain", "free_nodes": free,
                              "free_node_tolerance": FREE_NODE_TOLERANCE, "chain_k": chain[1],
                              "chain_predicted_speedup": chain[2]}
    why = (f"the verify curve takes {free} draft node(s) within {FREE_NODE_TOLERANCE:.0%} of one pass, "
           f"the chain drafts {chain[1]}")
    if w < 2:
        log(f"eval.tree auto: chains ({why})")
        return subject, chain, record
    topk = min(cfg_eval.tree_topk, w)
    tree_subject = replace(subject, factory=subject.sized(topk, w))
    cal, best_k, best_speedup = calibrate_drafter(target, tree_subject, prompts, verify)
    whole = ideal_speedup(cal.stats, verify, cal.draft_cost)
    wins = best_k > 0 and whole > max(chain[2], 1.0)
    record.update(tree_predicted_speedup=whole, topk=topk, tokens=w, used="dynamic" if wins else "chain")
    log(f"eval.tree auto: {'a dynamic tree' if wins else 'chains'} ({why}; a top-{topk}, {w}-node tree's "
        f"calibration predicts {whole:.2f}x, the chain's {chain[2]:.2f}x)")
    return (tree_subject, (cal, best_k, best_speedup), record) if wins else (subject, chain, record)


def measure_costs(target: Target, subject: Subject, cfg_eval: EvalConfig,
                  questions: dict[str, list[Question]],
                  log: Callable[[str], None] = print) -> tuple[Costs, Subject]:
    """The verify curve T(n), the off-benchmark calibrations, the draft lengths and the tree they choose; the
    subject drafting that tree (a new one where eval.tree "auto" became a dynamic tree, see choose_tree)."""
    first = next(iter(questions.values()))[0]
    context = int(prompt_ids(target.tok, [{"role": "user", "content": first.turns[0]}], target.device).shape[1])
    verify = measure_verify_cost(target.model, context_len=context, ks=VERIFY_SIZES, repeats=5,
                                 cache=cfg_eval.cache)
    k = cfg_eval.num_draft_tokens  # checked (>= 1) with the request
    # Calibration: acceptance per depth at k = 8 and the draft cost line (fixed + per token), off-benchmark;
    # for a hybrid the head's (here) and the n-gram's (below) separately: the policy's prior per proposer.
    prompts = calibration_prompts(target.tok, target.device)
    chosen = calibrate_drafter(target, subject, prompts, verify)
    tree: dict[str, Any] = {"configured": cfg_eval.tree, "used": cfg_eval.tree}
    if cfg_eval.tree == "dynamic":
        tree.update(topk=cfg_eval.tree_topk, tokens=cfg_eval.tree_tokens)
    if subject.sized is not None and k is None:  # a fixed k is a chain length (eval.num_draft_tokens)
        subject, chosen, tree = choose_tree(target, subject, cfg_eval, prompts, verify, chosen, log)
    cal, best_k, best_speedup = chosen
    cal_ng = cal if subject.drafter == "ngram" else calibrate(target.model, NgramDrafter(), prompts, k=8,
                                                              max_new_tokens=32, eos_token_id=target.eos)
    k_ng = max(choose_k(cal_ng.acceptance, verify, cal_ng.draft_cost, k_max=8, draft_rate=cal_ng.draft_rate)[0], 1)
    # choose_k returns 0 when plain decoding is predicted fastest; the eval still measures k = 1 then.
    k = max(best_k, 1) if k is None else k
    return Costs(verify, cal, cal_ng, best_k, best_speedup, ngram_best_k=k_ng, k=k,
                 k_ng=k if subject.drafter == "ngram" else k_ng, tree=tree), subject
