"""Benchmark the exact speculative decoder on SmolLM2-135M (CPU, batch 1, greedy, bundled prompts).

    python scripts/bench_decode.py --json out.json                  # n-gram + self-speculative drafters
    python scripts/bench_decode.py --head runs/eagle3 --json out.json   # plus a trained head's drafter
    python scripts/bench_decode.py --max-new-tokens 64 --num-prompts 2 --threads 1
    python scripts/bench_decode.py --no-self --json out.json        # skip the (slow) self-speculative rows

Steps: measure the verify cost curve T(k) and plain greedy decoding with our loop (the reference outputs);
run transformers' own generate, plain and with prompt_lookup_num_tokens=10, on the same prompts; for each
drafter calibrate acceptance and draft cost on held-out prompts, choose k from the cost model (eval.costs),
then decode the benchmark prompts (every method on a prompt before the next prompt, so load drift on a
shared machine hits all alike) and check the outputs are token-identical to plain greedy.
Prompts (with the target's chat template) cycle through: a code edit that copies a HumanEval function
(reformat it), an MT-bench question, a GSM8K problem. A drafter with several variants (the n-gram's
smallest match length) is calibrated in each and the variant with the best predicted speedup runs.
When the cost model says drafting does not pay (k = 0: plain decoding), a forced k = 1 run is reported
as `forced_k1` so the drafter's tau and overhead are still measured.
Adaptive rows (`<name>_adaptive`) run the same drafter under eval.policy.AdaptivePolicy (per-pass k from the
request's own acceptance, its calibration as the prior, starting at the calibrated k). Hybrid rows
(`<base>+ngram`, adaptive) merge the n-gram proposal into the base drafter's tree (eval.drafters.HybridDrafter;
the base is the trained head with --head, else the self-speculative draft), each proposer priced with its
own calibration; they report the accepted tokens per proposer and the chosen k per proposer.

JSON keys: plain_tokens_per_s, hf_plain_tokens_per_s, hf_prompt_lookup_tokens_per_s,
hf_prompt_lookup_speedup, drafters.<name>.{tokens_per_s, speedup, tau, outputs_identical, k,
acceptance_rates, predicted_speedup, ideal_speedup, overhead_ratio, chosen_k, accepted_by_source, ...},
overhead_ratio.<name>,
verify_cost_ms.<k>, block_pass_vs_eagle3_step (one DFlash block pass, B = 8, against one EAGLE-3 draft step, and
a drafting pass, draft + commit, at k = 1 and 3 of the shipped block drafter and EAGLE-3: block_pass_vs_step;
`--block-vs-step` runs only that row). speedup = tokens/s over plain greedy with our loop (whole generation, prefill included);
overhead_ratio = measured decode-phase speedup / ideal speedup from measured tau, T(k) and draft cost.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from data.cli import cli_main  # noqa: E402
from data.config import TargetConfig, load_config  # noqa: E402
from data.regenerate import render_rows  # noqa: E402
from data.target import TargetLoadError, load_target  # noqa: E402
from eval.costs import (  # noqa: E402
    DRAFT_DTYPES,
    VerifyCost,
    calibrate,
    choose_k,
    ideal_speedup,
    measure_verify_cost,
    place_head,
)
from eval.decoder import GenerationStats, plain_generate, speculative_generate  # noqa: E402
from eval.drafters import DeferredSync, HybridDrafter, NgramDrafter, self_speculative_drafter  # noqa: E402
from eval.policy import AdaptivePolicy, LearnedVerifyCost, measured_prior  # noqa: E402

BUNDLED = ROOT / "data" / "bundled"


# ----------------------------------------------------------------------------------------------- prompts
def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_texts(n: int, offset: int = 0) -> list[tuple[str, str]]:
    """n (category, user message) pairs cycling code / chat / math; `offset` picks other items (calibration)."""
    code = _read_jsonl(BUNDLED / "HumanEval.jsonl.gz")
    chat = _read_jsonl(BUNDLED / "mt_bench.jsonl")
    math = _read_jsonl(BUNDLED / "gsm8k_test.jsonl")
    out = []
    for i in range(n):
        j = offset + i // 3
        kind = i % 3
        if kind == 0:
            item = code[j % len(code)]
            src = item["prompt"] + item["canonical_solution"]
            out.append(("code", "Fix the indentation and formatting of this code, and return the complete "
                        "corrected code:\n```python\n" + src + "```"))
        elif kind == 1:
            out.append(("chat", chat[j % len(chat)]["turns"][0]))
        else:
            out.append(("math", math[j % len(math)]["question"]))
    return out


def encode(tok, text: str) -> torch.Tensor:
    return torch.tensor(render_rows(tok, [[{"role": "user", "content": text}]]))


# ----------------------------------------------------------------------------------------------- runs
def per_token_decode(st: GenerationStats) -> float:
    """Decode seconds per token after the first (the first comes from the prefill)."""
    return st.decode_time_s / max(st.new_tokens - st.generations, 1)


class Plan:
    """One drafter configuration chosen by calibration (variant and k) plus what its runs accumulate."""

    def __init__(self, name: str, variants: dict, calib_k: int, model, calib_prompts, verify: VerifyCost,
                 args, eos):
        best = None
        for label, make in variants.items():
            cal = calibrate(model, make(), calib_prompts, k=calib_k, max_new_tokens=args.calib_tokens,
                            eos_token_id=eos)
            k, predicted = choose_k(cal.acceptance, verify, cal.draft_cost, args.k_max, cal.draft_rate)
            if best is None or predicted > best[3]:
                best = (label, make, k, predicted, cal)
        self.name = name
        self.variant, self.make, self.k, self.predicted, self.cal = best
        # When the cost model picks plain decoding (k = 0), k = 1 is also run to measure the drafter anyway.
        self.ks = [self.k] if self.k > 0 else [0, 1]
        self.policy = None
        self.outs: dict[int, list[list[int]]] = {k: [] for k in self.ks}
        self.stats: dict[int, GenerationStats] = {k: GenerationStats() for k in self.ks}

    def adaptive(self, name: str, make, policy) -> Plan:
        """A row running `make` under policy(self) (a fresh AdaptivePolicy per prompt), starting at this plan's
        calibrated k (at least 1); it reuses this plan's calibration (variant, k, draft cost, prediction)."""
        new = copy.copy(self)
        new.name, new.make, new.policy = name, make, policy
        new.ks = [max(self.k, 1)]
        new.outs, new.stats = {new.ks[0]: []}, {new.ks[0]: GenerationStats()}
        return new

    def run(self, model, ids: torch.Tensor, args, eos) -> None:
        for k in self.ks:
            policy = None if self.policy is None else self.policy()
            out, st = speculative_generate(model, ids, self.make(), k, args.max_new_tokens, eos_token_id=eos,
                                           policy=policy)
            self.outs[k].append(out.tolist())
            self.stats[k] = self.stats[k].merge(st)

    def row(self, k: int, plain: GenerationStats, ref_outs: list[list[int]], verify: VerifyCost) -> dict:
        st = self.stats[k]
        ideal = ideal_speedup(st, verify, self.cal.draft_cost)
        measured_decode = per_token_decode(plain) / per_token_decode(st)
        return {
            "k": k,
            "tokens_per_s": round(st.tokens_per_s, 2),
            "speedup": round(st.tokens_per_s / plain.tokens_per_s, 3),
            "decode_speedup": round(measured_decode, 3),
            "tau": round(st.tau, 3),
            "outputs_identical": self.outs[k] == ref_outs,
            "acceptance_rates": [round(a, 3) for a in st.acceptance_rates],
            "draft_rate": round(st.draft_rate, 3),
            "ideal_speedup": round(ideal, 3),
            "overhead_ratio": round(measured_decode / ideal, 3) if k > 0 else None,
            "chosen_k": {src: {str(n): c for n, c in sorted(v.items())} for src, v in st.chosen_k.items()},
            "accepted_by_source": st.accepted_by_source,
            "draft_time_s": round(st.draft_time_s, 3),
            "verify_time_s": round(st.verify_time_s, 3),
            "new_tokens": st.new_tokens,
        }

    def report(self, plain: GenerationStats, ref_outs: list[list[int]], verify: VerifyCost) -> dict:
        out = self.row(self.ks[0], plain, ref_outs, verify)
        out.update(
            variant=self.variant,
            predicted_speedup=round(self.predicted, 3),
            calibration_acceptance=[round(a, 3) for a in self.cal.acceptance],
            draft_cost_ms={"fixed": round(self.cal.draft_cost.fixed_s * 1e3, 3),
                           "per_token": round(self.cal.draft_cost.per_token_s * 1e3, 3)},
        )
        if len(self.ks) > 1:
            out["forced_k1"] = self.row(1, plain, ref_outs, verify)
        return out


def hf_generate(model, ids: torch.Tensor, max_new: int, **kw) -> tuple[list[int], float]:
    t = time.perf_counter()
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new, **kw)[0, ids.shape[1]:]
    return out.tolist(), time.perf_counter() - t


@cli_main
def block_pass_vs_step(model, io, prompt: torch.Tensor, reps: int = 30, draft_dtype: str = "auto") -> dict:
    """One DFlash block pass (B = 8: 7 drafted tokens) against one EAGLE-3 draft step (and 3 drafted tokens of
    the shipped block drafter, configs/smollm2-135m-dflash.yaml's head, against EAGLE-3's 3), freshly built with
    the quickstart's head sizes (configs/smollm2-135m.yaml: draft vocab 2048, one draft layer), on the same
    prompt's features. EAGLE-3's step = (draft(5) - draft(1)) / 4 (its
    first token comes from the logits cached at commit; each further token is one pass of its layer); the
    block = draft(7). Medians of `reps` calls. Target of issue 25: ratio <= 2. Each head drafts in the dtype
    eval.draft_dtype `draft_dtype` gives it (eval.costs.place_head), as eval.run's would."""
    from data.features import forward_features
    from heads import dflash, eagle

    torch.manual_seed(0)
    e3 = eagle.build(eagle.Eagle3Config(draft_vocab_size=2048, ttt_length=3), io).eval()
    blk = dflash.build(dflash.DFlashConfig(draft_vocab_size=2048, block_size=8), io).eval()
    for h in (e3, blk):
        place_head(h, prompt.device, torch.float32, draft_dtype)
    feats = forward_features(model, prompt, None, e3.layer_ids)[0]
    de, dd = eagle.drafter(e3, io), dflash.drafter(blk, io)
    de.begin(prompt, feats, 0)
    dd.begin(prompt, feats, 0)

    def median_s(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    step = (median_s(lambda: de.draft(5, 0.0)) - median_s(lambda: de.draft(1, 0.0))) / 4
    block = median_s(lambda: dd.draft(7, 0.0))
    # The shipped block drafter (its config's head: blocks of 3, one pass, then 3 sequential Markov draws)
    # drafting its 3 tokens against EAGLE-3 drafting 3 (two passes of its layer after the cached first token).
    ds = dflash.build(load_config(ROOT / "configs/smollm2-135m-dflash.yaml").head, io).eval()
    place_head(ds, prompt.device, torch.float32, draft_dtype)
    dsd = dflash.drafter(ds, io)
    dsd.begin(prompt, feats, 0)
    row = {"block_size": 8, "context": int(prompt.shape[1]), "eagle3_step_ms": round(step * 1e3, 3),
           "dflash_block_ms": round(block * 1e3, 3), "ratio": round(block / step, 2),
           "eagle3_draft3_ms": round(median_s(lambda: de.draft(3, 0.0)) * 1e3, 3),
           "shipped_dflash_draft3_ms": round(median_s(lambda: dsd.draft(3, 0.0)) * 1e3, 3)}
    # A whole drafting pass as the decoder pays it: draft(k), then the commit of its first token accepted (two
    # feature rows: the pass's root and that token). What the policy prices a pass at; EAGLE-3's first token is
    # nearly free to draft because its commit computed the logits, the block drafter runs its block for any k.
    n = prompt.shape[1]
    last, nxt = feats.slice(n - 2, n), int(prompt[0, n - 1])
    for name, head, make in (("eagle3", e3, eagle.drafter), ("shipped_dflash", ds, dflash.drafter)):
        for k in (1, 3):
            d = make(head, io)
            d.begin(prompt[:, : n - 2], feats.slice(0, n - 2), int(prompt[0, n - 2]))

            def drafting_pass(d=d, k=k) -> None:
                d.draft(k, 0.0)
                d.commit([0], last, nxt)  # the context grows by 2 a call, as in decoding
            row[f"{name}_pass_k{k}_ms"] = round(median_s(drafting_pass) * 1e3, 3)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="target name or path (default smollm2-135m)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=3, help="prompts, cycling code / chat / math")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--head", type=Path, help="a trained head folder to benchmark too (heads.base.load_head)")
    ap.add_argument("--self-layers", type=int, default=24, help="layers in the self-speculative draft")
    ap.add_argument("--k-max", type=int, default=16, help="largest draft length considered")
    ap.add_argument("--calib-k", type=int, default=10, help="draft length of the calibration runs")
    ap.add_argument("--calib-tokens", type=int, default=48, help="new tokens per calibration prompt")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--no-self", action="store_true", help="skip the self-speculative rows (slow on a CPU)")
    ap.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                    help="the dtype the heads draft in (eval.draft_dtype)")
    ap.add_argument("--block-vs-step", action="store_true",
                    help="only the row of one DFlash block pass (B = 8) against one EAGLE-3 draft step")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tok, io = load_target(TargetConfig(name_or_path=args.target, device="cpu", dtype="float32"), decode=True, verify=True)
    except TargetLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    eos = model.generation_config.eos_token_id
    texts = prompt_texts(args.num_prompts)
    prompts = [encode(tok, t) for _, t in texts]
    calib_prompts = [encode(tok, t) for _, t in prompt_texts(2, offset=40)]
    with torch.inference_mode():
        block_row = block_pass_vs_step(model, io, prompts[0], draft_dtype=args.draft_dtype)
    print(f"one DFlash block pass (B = 8) vs one EAGLE-3 draft step at context {block_row['context']}: "
          f"{block_row['dflash_block_ms']:.2f} ms vs {block_row['eagle3_step_ms']:.2f} ms = {block_row['ratio']:.2f}x; "
          f"3 drafted tokens, the shipped block drafter vs EAGLE-3: {block_row['shipped_dflash_draft3_ms']:.2f} ms vs "
          f"{block_row['eagle3_draft3_ms']:.2f} ms; a drafting pass (draft + commit) at k = 1 / 3: "
          f"{block_row['shipped_dflash_pass_k1_ms']:.2f} / {block_row['shipped_dflash_pass_k3_ms']:.2f} ms vs "
          f"{block_row['eagle3_pass_k1_ms']:.2f} / {block_row['eagle3_pass_k3_ms']:.2f} ms")
    if args.block_vs_step:
        return {"block_pass_vs_eagle3_step": block_row}
    ctx = int(statistics.fmean(p.shape[1] for p in prompts) + args.max_new_tokens / 2)

    print(f"target {args.target}: {torch.get_num_threads()} threads, {len(prompts)} prompts "
          f"({', '.join(f'{c} {p.shape[1]} tok' for (c, _), p in zip(texts, prompts))}), "
          f"max_new_tokens {args.max_new_tokens}; measuring T(k) at context {ctx}")
    verify = measure_verify_cost(model, context_len=ctx, repeats=3)
    with torch.inference_mode():
        # name -> (variants {label: factory}, calibration draft length)
        drafters = {
            "ngram": ({f"n={n_min}..3": (lambda n_min=n_min: NgramDrafter(n_max=3, n_min=n_min))
                       for n_min in (1, 2)}, args.calib_k),
        }
        if not args.no_self:
            drafters["self_speculative"] = ({f"{args.self_layers} layers": lambda: self_speculative_drafter(
                model, args.self_layers)}, min(args.calib_k, 4))
        base = "self_speculative" if not args.no_self else None
        if args.head:
            from heads import registry
            from heads.base import load_head

            head, cfg, _ = load_head(args.head, io)
            place_head(head, torch.device("cpu"), torch.float32, args.draft_dtype)
            base = f"head_{cfg.family}"
            # eval.tree "auto": the family's default drafter (k only shapes a Medusa chain, unused here)
            make = registry.get(cfg.family).drafter_factory(head, io, "auto", 4)
            drafters[base] = ({str(args.head): make}, min(args.calib_k, 6))
        plans = {name: Plan(name, variants, ck, model, calib_prompts, verify, args, eos)
                 for name, (variants, ck) in tqdm(drafters.items(), desc="calibrating", leave=False)}

        learned = LearnedVerifyCost(verify)  # T(n) refined by every adaptive row's timed passes
        for name, p in list(plans.items()):  # the same drafters under the adaptive policy
            plans[f"{name}_adaptive"] = p.adaptive(f"{name}_adaptive", lambda p=p: DeferredSync(p.make()), lambda p=p: AdaptivePolicy(
                learned, {"draft": p.cal.draft_cost}, {"draft": measured_prior(p.cal.stats)}))
        if base is not None:
            b, ng = plans[base], plans["ngram"]
            plans[f"{base}+ngram"] = b.adaptive(
                f"{base}+ngram", lambda: HybridDrafter(b.make(), ng.make()),
                lambda: AdaptivePolicy(learned, {"head": b.cal.draft_cost, "ngram": ng.cal.draft_cost},
                                       {"head": measured_prior(b.cal.stats), "ngram": measured_prior(ng.cal.stats)}))
        plans = list(plans.values())

        # Every method runs on a prompt before the next prompt starts, so a shared machine's load drift
        # hits all methods alike.
        ref_outs, plain = [], GenerationStats()
        hf = {"plain": ([], 0.0, 0), "lookup": ([], 0.0, 0)}
        bar = tqdm(prompts, desc="decoding", unit="prompt")
        for ids in bar:
            out, st = plain_generate(model, ids, args.max_new_tokens, eos_token_id=eos)
            ref_outs.append(out.tolist())
            plain = plain.merge(st)
            for key, kw in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": 10})):
                o, secs = hf_generate(model, ids, args.max_new_tokens, **kw)
                outs, total, n = hf[key]
                hf[key] = (outs + [o], total + secs, n + len(o))
            for plan in plans:
                plan.run(model, ids, args, eos)
            bar.set_postfix(plain_tok_s=f"{plain.tokens_per_s:.1f}")
        results = {plan.name: plan.report(plain, ref_outs, verify) for plan in plans}
    (hf_outs, hf_secs, hf_n), (pld_outs, pld_secs, pld_n) = hf["plain"], hf["lookup"]

    report = {
        "target": args.target,
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "prompts": [{"category": c, "prompt_tokens": p.shape[1]} for (c, _), p in zip(texts, prompts)],
        "plain_tokens_per_s": round(plain.tokens_per_s, 2),
        "plain_new_tokens": plain.new_tokens,
        "hf_plain_tokens_per_s": round(hf_n / hf_secs, 2),
        "hf_prompt_lookup_tokens_per_s": round(pld_n / pld_secs, 2),
        "hf_prompt_lookup_speedup": round((pld_n / pld_secs) / (hf_n / hf_secs), 3),
        "hf_outputs_identical": hf_outs == ref_outs and pld_outs == ref_outs,
        "drafters": results,
        "overhead_ratio": {name: r["overhead_ratio"] for name, r in results.items()},
        "verify_cost_ms": verify.ms(),
        "verify_cost_context": verify.context_len,
        "block_pass_vs_eagle3_step": block_row,
    }

    print(f"\nT(k) ms at context {ctx}: " + ", ".join(f"{k}: {v:.1f}" for k, v in verify.ms().items()))
    print(f"plain (ours) {report['plain_tokens_per_s']:.1f} tok/s | transformers plain {report['hf_plain_tokens_per_s']:.1f}"
          f" tok/s, prompt lookup (10) {report['hf_prompt_lookup_tokens_per_s']:.1f} tok/s = "
          f"{report['hf_prompt_lookup_speedup']:.2f}x, identical {report['hf_outputs_identical']}")
    head = f"{'drafter':<28}{'k':>3}{'tau':>7}{'tok/s':>8}{'speedup':>9}{'predicted':>10}{'ideal':>7}{'overhead':>9}  identical"
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        for label, row in ((name, r), ("  forced k=1", r.get("forced_k1"))):
            if row is None:
                continue
            ov = "-" if row["overhead_ratio"] is None else f"{row['overhead_ratio']:.2f}"
            pred = f"{r['predicted_speedup']:>9.2f}x" if row is r else f"{'':>10}"
            print(f"{label:<28}{row['k']:>3}{row['tau']:>7.2f}{row['tokens_per_s']:>8.1f}{row['speedup']:>8.2f}x"
                  f"{pred}{row['ideal_speedup']:>6.2f}x{ov:>9}  {row['outputs_identical']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
