"""Evaluate a drafter by what it does to generation: tau, acceptance per position, tokens/s, speedup, reports.

    python -m eval.run --head runs/tiny/head --bench mt_bench --max-questions 2 --out runs/tiny/eval
    python -m eval.run --head runs/qs/head --bench mt_bench,humaneval,gsm8k --temperature 0,1 --out runs/qs/eval
    python -m eval.run --drafter ngram --target tiny-random-llama --bench gsm8k --max-questions 2 --out /tmp/ev
    python -m eval.run --head runs/qs/head --drafter head+ngram --bench mt_bench,humaneval,gsm8k --out runs/qs/eval
    python -m eval.run --config configs/tiny-eagle.yaml --head runs/tiny/head --eval.max_new_tokens=16
    python -m eval.run --head runs/qs/head --bench gsm8k --engine vllm --out runs/qs/eval-vllm   # + vLLM

The target comes from the head folder's config.json unless --target or --config names one; a head made
for another target is refused with the mismatch named (exit code 2). Every question is asked turn by
turn; a later turn sees the target's own PLAIN-decoded answers to the earlier ones (MT-bench turn 2).
For every turn the methods run pass-interleaved (one pass of each per cycle, in a fresh order every cycle,
each timed over its own passes), so machine noise hits plain and speculative decoding alike:
  plain             token-by-token decoding (eval.decoder.plain_generate), the speedup reference
  head | ngram | head+ngram   the drafter under evaluation through the exact speculative decoder; head+ngram
                    is the head's tree with the n-gram proposal merged in as extra branches
                    (eval.drafters.HybridDrafter), and then the head alone runs beside it as well
  ngram             baseline: prompt lookup through the same decoder at its own calibrated k (fixed)
  hf_prompt_lookup  baseline: transformers' own prompt-lookup assisted generation at that k (greedy turns only)
With eval.policy "adaptive" (the default) the head-based methods (and the n-gram when it is the drafter
under evaluation) choose every pass's draft length per request (eval.policy.AdaptivePolicy: the calibration's
acceptance plus the benchmark's earlier turns as the prior, the measured T(n) and draft cost), down to plain
passes; "fixed" drafts k every pass.
tau is tokens per target forward pass counting the corrected or bonus token (SGLang's accept_length,
EAGLE's tau); tokens/s and speedup are end to end per turn (prefill included); decode_speedup leaves
prefill out and is what the speedup model predicts. Outputs in --out: report.json, report.md, *.png,
config.yaml (see eval/report.py). The batch-size sweep (eval/batch.py) runs once at the end.

Without a GPU the CLI runs torch on ONE thread unless --threads says otherwise: batch-1 decoding is
overhead-bound, and on a 2-core machine shared with other jobs two threads stall each other (the tiny
target's single-token pass measured 3-360 ms with 2 threads under load, 3-16 ms with 1), which would
drown the plain-vs-speculative comparison in noise. The thread count is recorded in report.json.

--engine vllm (the `vllm` extra; EAGLE-3 and DFlash heads) also serves the exported head in vLLM on the same
turns and writes benchmarks.<name>.vllm: vLLM's acceptance per position, mean acceptance length, tokens/s
with and without speculation, and its agreement with the built-in decoder (at T > 0 with vLLM's
probabilistic drafts; a disagreement there is reported as an engine fault, its numbers withheld); and
vllm_concurrency: the engine's tokens/s and tau at each of --batch-sizes requests in flight, plain, the
head at fixed k and with a per-batch-size draft length chosen from that curve (eval/vllm_engine.py).

From Python (train/*.py with train.eval_at_end): `evaluate(head_dir, cfg.eval, out_dir, cfg.target)`.

The jobs, one module each: this one the CLI and the stages of `evaluate` (checks, loading, the plan);
eval.calibrate the costs and the choice of k; eval.turns the turn loop; eval.tally the tallies and the
sections made from them; eval.report the report's assembly, text and plots; eval.vllm_engine the vLLM bridge.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from data.cli import UserError, cli_main, names_arg, number_arg
from data.config import EvalConfig, RunConfig, TargetConfig, config_text, parse_args, to_dict
from data.regenerate import eos_ids, render_rows
from data.target import load_target
from eval.batch import Method, sweep
from eval.bench import Question, bench_name, load_questions
from eval.calibrate import Costs, measure_costs
from eval.costs import dtype_name, measure_cost_surface, measure_draft_share, place_head, wide_rows
from eval.drafters import HybridDrafter, NgramDrafter
from eval.report import assemble_report, claim_eval_folder, markdown, write_report
from eval.tally import BASELINES, benchmarks_section, speedup_section
from eval.turns import Served, Subject, Target, Turns, adaptive_policy
from eval.vllm_engine import ServeError, add_served, check_servable  # imports vllm only when serving
from heads import registry
from heads.base import Drafter, load_head, read_head_config

DRAFTERS = ("head", "ngram", "head+ngram")
POLICIES = ("adaptive", "fixed")
SURFACE_SIZES = (1, 2, 3, 4, 6, 9, 17)  # tokens per row of the batch cost surface T(B, n): up to k_max 8 x two proposers


class EvalError(UserError, ValueError):
    """Bad eval input (flags, head folder, benchmark); the CLI prints it on one line and exits 2."""



# ----------------------------------------------------------------------------------------------- stages
def _check_request(cfg_eval: EvalConfig, drafter: str, head_dir: str | Path | None,
                   baselines: Sequence[str]) -> None:
    """Refuse bad flags before anything is read or loaded."""
    if drafter not in DRAFTERS:
        raise EvalError(f"--drafter must be one of {', '.join(DRAFTERS)}, got '{drafter}'")
    if drafter != "ngram" and head_dir is None:
        raise EvalError(f"--drafter {drafter} needs --head PATH (or use --drafter ngram)")
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        raise EvalError(f"unknown baseline '{unknown[0]}' (known: {', '.join(BASELINES)})")
    if cfg_eval.num_draft_tokens is not None and cfg_eval.num_draft_tokens < 1:
        raise EvalError(f"eval.num_draft_tokens must be >= 1, got {cfg_eval.num_draft_tokens}")
    if not cfg_eval.temperature:
        raise EvalError("eval.temperature is empty")
    if any(t < 0 for t in cfg_eval.temperature):
        raise EvalError(f"eval.temperature must be >= 0, got {cfg_eval.temperature}")


def _resolve_target(head_dir: str | Path | None,
                    target_cfg: TargetConfig | None) -> tuple[dict[str, Any] | None, TargetConfig]:
    """The head folder's record (None without a head) and the target (the head's own by default)."""
    head_meta: dict[str, Any] | None = None
    if head_dir is not None:
        _, head_meta = read_head_config(head_dir)
        if target_cfg is None:
            target_cfg = TargetConfig(name_or_path=head_meta["target"]["name_or_path"])
    if target_cfg is None:
        raise EvalError("no target: give --head, --target or --config")
    return head_meta, target_cfg


def _check_engine(engine: str, head_meta: dict[str, Any] | None, drafter: str, tree: str) -> None:
    """Refuse, before any model is loaded, what the engine cannot serve."""
    if engine not in ("builtin", "vllm"):
        raise EvalError(f"--engine must be builtin or vllm, got '{engine}'")
    if engine == "vllm":
        try:
            check_servable(head_meta["family"] if head_meta else None, drafter, tree,
                           head_meta.get("head_config") if head_meta else None)
        except ServeError as e:
            raise EvalError(str(e)) from None


def _load(target_cfg: TargetConfig, loaded: tuple[nn.Module, Any, Any] | None, head_dir: str | Path | None,
          drafter: str, baselines: Sequence[str], ev: EvalConfig,
          log: Callable[[str], None] = print, engine: str = "builtin") -> tuple[Target, Subject]:
    """The target (or the one already in memory) and the head on its device, in the dtype it drafts in
    (eval.draft_dtype); the methods to run, whose drafters follow eval.tree (and its sizes). Where eval.tree is
    "auto", the family has a dynamic tree and the engine is the built-in one (--engine vllm compares chains), the
    Subject also carries the sized tree factories the cost stage may choose instead (eval.calibrate.choose_tree)."""
    model, tok, io = loaded if loaded is not None else load_target(target_cfg, decode=True, verify=True)
    device = next(model.parameters()).device
    head = head_cfg = drafts_in = None
    if head_dir is not None:
        head, head_cfg, _ = load_head(head_dir, io)  # refuses another target's head, naming why
        # the head casts the target's features and embeddings to its own dtype (each family's drafter)
        drafts_in = dtype_name(place_head(head, device, next(model.parameters()).dtype, ev.draft_dtype, log))
        if rows := wide_rows(head):
            drafts_in += f" (float32 from {rows} rows)"
    hybrid = drafter == "head+ngram"
    name = head_cfg.family if head_cfg is not None else "head"
    main = "ngram" if drafter == "ngram" else f"{name}+ngram" if hybrid else name
    methods = [main] + ([name] if hybrid else []) + [b for b in baselines if b != main]

    # a dynamic tree's sizes go to the families that have one (check_eval_tree refuses it for the others)
    sizes = {"topk": ev.tree_topk, "tokens": ev.tree_tokens} if ev.tree == "dynamic" else {}

    def drafters(tree: str, **tree_sizes: int) -> Callable[[int], Callable[[], Drafter]]:
        # the family maps eval.tree onto its own options (HeadError, one line, for a tree it does not have)
        return lambda k: NgramDrafter if drafter == "ngram" else \
            registry.get(head_cfg.family).drafter_factory(head, io, tree, k, **tree_sizes)

    def sized(topk: int, tokens: int) -> Callable[[int], Callable[[], Drafter]]:
        return drafters("dynamic", topk=topk, tokens=tokens)

    may_tree = (ev.tree == "auto" and engine == "builtin" and head_cfg is not None and drafter != "ngram"
                and "dynamic" in registry.get(head_cfg.family).trees)
    # the head's draft vocabulary (EAGLE-3's, the block drafter's t2d), where it is smaller than the target's
    t2d = getattr(head, "t2d", None) if drafter != "ngram" else None
    vocab = t2d.detach().cpu().bool() if t2d is not None and not bool(t2d.all()) else None
    target = Target(model, tok, io, device, eos_ids(model, tok))
    return target, Subject(drafter, head_cfg, main, methods, drafters(ev.tree, **sizes), drafts_in,
                           sized if may_tree else None, vocab)


def _plan_line(target_cfg: TargetConfig, subject: Subject, costs: Costs, cfg_eval: EvalConfig,
               questions: dict[str, list[Question]]) -> str:
    """The log line that says what runs, before the turns start."""
    return (f"eval: target {target_cfg.name_or_path}, drafter {subject.main}, tree {costs.tree_text()}, k {costs.k} "
            f"({'config' if cfg_eval.num_draft_tokens else 'chosen from measured costs and calibration'}), "
            f"policy {cfg_eval.policy}, n-gram baseline k {costs.k_ng}, methods "
            f"{', '.join(['plain'] + subject.methods)}, benchmarks {', '.join(questions)}")


def _sweep_methods(subject: Subject, costs: Costs, draft_share: dict[int, float] | None = None) -> list[Method]:
    """The batch sweep's speculative methods: the drafter under evaluation at its fixed k, the hybrid at k, and
    the load-aware policy (eval.policy.LoadAware) over the richest of them, its head's drafts priced at
    `draft_share`; n-gram alone without a head."""
    if subject.drafter == "ngram":
        return [Method("ngram", costs.k, NgramDrafter),
                Method("ngram load-aware", costs.k, NgramDrafter, lambda: adaptive_policy(costs, costs.verify, False),
                       load_aware=True)]
    make_head = subject.factory(costs.k)
    name = subject.head_cfg.family

    def hybrid() -> Drafter:
        return HybridDrafter(make_head())

    return [Method(name, costs.k, make_head), Method(f"{name}+ngram", costs.k, hybrid),
            Method(f"{name}+ngram load-aware", costs.k, hybrid, lambda: adaptive_policy(costs, costs.verify, True),
                   load_aware=True, draft_share=draft_share)]


def _batch_sweep(target: Target, subject: Subject, costs: Costs, questions: dict[str, list[Question]],
                 batch_sizes: list[int], sweep_new_tokens: int, log: Callable[[str], None],
                 repeats: int = 2, load_aware_repeats: int = 8) -> dict[str, Any]:
    """report.json's `batch_sweep` (eval/batch.py) on every question's first turn: plain, the drafter under
    evaluation and the hybrid at fixed k, and the load-aware policy priced by the cost surface T(B, n) measured
    here first (eval.costs.measure_cost_surface), its head's drafts at the share of a row's own draft that
    drafting the rows together costs, measured here too (eval.costs.measure_draft_share)."""
    tok = target.tok
    prompts = render_rows(tok, [[{"role": "user", "content": q.turns[0]}] for qs in questions.values() for q in qs])
    share = None
    if subject.drafter != "ngram":
        share = measure_draft_share(target.model, subject.factory(costs.k), prompts[0], batch_sizes, max(costs.k, 1))
    methods = _sweep_methods(subject, costs, share)
    context = sum(len(p) for p in prompts) // len(prompts)
    shares = "" if not share else (f"; a row's head draft, drafted with the batch's, costs "
                                   f"{' / '.join(f'{f:.2f}' for f in share.values())} of its own at batch "
                                   f"{' / '.join(map(str, share))}")
    log(f"batch sweep: batch sizes {batch_sizes}, methods {', '.join(m.name for m in methods)}, "
        f"{sweep_new_tokens} new tokens per row{shares}; measuring T(B, n) at a {context}-token context first")
    surface = measure_cost_surface(target.model, batch_sizes, SURFACE_SIZES, context_len=context)
    return sweep(target.model, prompts, tok.pad_token_id if tok.pad_token_id is not None else target.eos[0],
                 batch_sizes, methods, max_new_tokens=sweep_new_tokens, surface=surface, progress=log,
                 repeats=repeats, load_aware_repeats=load_aware_repeats)


def evaluate(
    head_dir: str | Path | None,
    cfg_eval: EvalConfig,
    out_dir: str | Path,
    target_cfg: TargetConfig | None = None,
    *,
    drafter: str = "head",
    baselines: Sequence[str] = BASELINES,
    sweep_new_tokens: int = 32,
    sweep_repeats: int = 2,
    sweep_load_aware_repeats: int = 8,
    seed: int = 0,
    loaded: tuple[nn.Module, Any, Any] | None = None,
    log: Callable[[str], None] = print,
    engine: str = "builtin",
    config_yaml: str | None = None,
) -> dict[str, Any]:
    """Run the whole eval and write the report files into out_dir; returns the report dict (report.json).

    head_dir: a head folder (drafter "head" or "head+ngram"), or None with drafter "ngram" (prompt lookup alone).
    target_cfg: the target to load (default: the one named in the head's config.json; for drafter
    "ngram" without a head it is required). loaded: (model, tokenizer, TargetIO) already in memory, used
    instead of loading (the head is still checked against it). engine "vllm": also serve the head in vLLM
    (eval/vllm_engine.py). config_yaml: written as config.yaml with the report (eval/report.py's
    write_report says in which order). Raises HeadMismatchError for a head made
    for another target, EvalError / DataError / TargetLoadError for bad input.

    The stages, in order (each a function here, or in the module the module docstring names for its job):
    check the request, resolve the target, read the questions, check the engine, load target and head,
    measure costs and choose k, run every turn with every method, tabulate the benchmarks, serve in vLLM
    (--engine vllm), fit the speedup model, sweep batch sizes, assemble and write the report.
    """
    _check_request(cfg_eval, drafter, head_dir, baselines)
    claim_eval_folder(out_dir)
    head_meta, target_cfg = _resolve_target(head_dir, target_cfg)
    questions = {bench_name(b): load_questions(b, cfg_eval.max_questions) for b in cfg_eval.bench}
    _check_engine(engine, head_meta, drafter, cfg_eval.tree)
    target, subject = _load(target_cfg, loaded, head_dir, drafter, baselines, cfg_eval, log, engine)
    costs, subject = measure_costs(target, subject, cfg_eval, questions, log)
    log(_plan_line(target_cfg, subject, costs, cfg_eval, questions))
    served: Served | None = {} if engine == "vllm" else None
    runs = Turns(target, subject, costs, cfg_eval, seed, served).run(questions)
    benchmarks = benchmarks_section(runs, subject.methods, questions, cfg_eval.temperature)
    engine_curve = None
    if served is not None:
        try:
            engine_curve = add_served(benchmarks, head_dir, target, target_cfg, served, dict(runs), subject.main,
                                      costs.k, cfg_eval.max_new_tokens, seed, log, cfg_eval.batch_sizes,
                                      sweep_new_tokens)
        except ServeError as e:
            raise EvalError(str(e)) from None
    speedup = speedup_section(runs[0][1], subject.main, costs)
    batch = _batch_sweep(target, subject, costs, questions, cfg_eval.batch_sizes, sweep_new_tokens, log,
                         sweep_repeats, sweep_load_aware_repeats)
    report = assemble_report(target_cfg, head_dir, subject, costs, cfg_eval, target.device,
                             benchmarks=benchmarks, speedup=speedup, batch=batch, vllm_concurrency=engine_curve)
    write_report(report, out_dir, config_yaml)
    return report


# ----------------------------------------------------------------------------------------------- CLI
def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", help="head folder (config.json + model.safetensors)")
    p.add_argument("--drafter", choices=DRAFTERS, help="what to evaluate (default: head if --head, else ngram); "
                   "head+ngram merges the n-gram proposal into the head's tree and runs the head alone beside it")
    p.add_argument("--policy", choices=POLICIES, help="adaptive: per-pass draft length from the request's acceptance "
                   "(default); fixed: k every pass")
    p.add_argument("--target", help="target name_or_path (default: the head's own target, or the config's)")
    # Every range is checked here, at parse time (data.cli.number_arg: one line, exit 2, before any work).
    p.add_argument("--bench", type=names_arg("--bench"), help="comma-separated: mt_bench, humaneval, gsm8k or question files")
    p.add_argument("--temperature", type=number_arg("--temperature", float, 0, many=True),
                   help="comma-separated temperatures, e.g. 0,1")
    p.add_argument("--max-new-tokens", type=number_arg("--max-new-tokens"))
    p.add_argument("--max-questions", type=number_arg("--max-questions"))
    p.add_argument("--k", type=number_arg("--k"), help="draft length (default: chosen from measured costs)")
    p.add_argument("--batch-sizes", type=number_arg("--batch-sizes", many=True),
                   help="batch sizes of the sweep, e.g. 1,2,4,8,16")
    p.add_argument("--sweep-new-tokens", type=number_arg("--sweep-new-tokens"), default=32,
                   help="tokens per row in the batch sweep")
    p.add_argument("--sweep-repeats", type=number_arg("--sweep-repeats"), default=2,
                   help="rounds per batch size in the sweep, order rotated (speedup: median of per-round ratios)")
    p.add_argument("--sweep-load-aware-repeats", type=number_arg("--sweep-load-aware-repeats"), default=8,
                   help="rounds in all for the load-aware policy, the extra ones beside plain only (its bound "
                   "is 2%% of plain; one round of plain against plain varied by 1.5-3%% (sd) on a 2-core VM)")
    p.add_argument("--threads", type=number_arg("--threads", minimum=0),
                   help="torch CPU threads (default without a GPU: 1, see the module doc; "
                   "0 = torch's own choice)")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="vllm: also serve the exported head in vLLM, compare, and measure the engine's "
                   "throughput at each --batch-sizes concurrency (the vllm extra; EAGLE-3, DFlash)")
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help=f"comma-separated subset of {','.join(BASELINES)} (empty for none)")


@cli_main
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg, args = parse_args("Evaluate a drafter: tau, acceptance, speedup, batch sweep, reports.", argv, _flags)
    ev: EvalConfig = cfg.eval
    if args.bench:
        ev.bench = args.bench
    for flag, field_name in (("temperature", "temperature"), ("max_new_tokens", "max_new_tokens"),
                             ("max_questions", "max_questions"), ("k", "num_draft_tokens"),
                             ("batch_sizes", "batch_sizes"), ("policy", "policy")):
        if getattr(args, flag) is not None:
            setattr(ev, field_name, getattr(args, flag))
    drafter = args.drafter or ("head" if args.head else "ngram")
    target_cfg: TargetConfig | None = None
    if args.target:
        target_cfg = TargetConfig(**{**to_dict(cfg.target), "name_or_path": args.target}) if args.config else \
            TargetConfig(name_or_path=args.target)
    elif args.config:
        target_cfg = cfg.target
    elif not args.head:
        target_cfg = RunConfig().target
    out = Path(cfg.out if (args.out or args.config) else "runs/eval")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    threads = args.threads if args.threads is not None else (0 if torch.cuda.is_available() else 1)
    if threads > 0:
        torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()  # generate()'s notes on generation flags are noise here
    claim_eval_folder(out)  # before any work: a folder eval must not write into is refused at once
    report = evaluate(args.head, ev, out, target_cfg, drafter=drafter,
                      baselines=[b.strip() for b in args.baselines.split(",") if b.strip()],
                      sweep_new_tokens=args.sweep_new_tokens, sweep_repeats=args.sweep_repeats,
                      sweep_load_aware_repeats=args.sweep_load_aware_repeats, seed=cfg.seed,
                      engine=args.engine,
                      config_yaml=config_text(cfg))
    print(markdown(report))
    print(f"wrote {out / 'report.json'}, {out / 'report.md'} and plots")


if __name__ == "__main__":
    main()
