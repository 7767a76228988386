"""Benchmark what a pass that drafts nothing costs against a plain pass, single stream and batched (CPU or GPU).

    python scripts/bench_batch.py --head runs/quickstart/head --json out.json --threads 1
    python scripts/bench_batch.py --batch-sizes 1,4,16 --new-tokens 48 --repeats 5   # a fresh EAGLE-3 head
    python scripts/bench_batch.py --head runs/quickstart/head --together --k 3 --threads 0   # only the table below
    python scripts/bench_batch.py --config configs/smollm2-135m-dflash.yaml --together --k 3   # a fresh DFlash head

Where the policy turns drafting off, speculative decoding must cost what plain decoding costs. Per prompt and
repeat, the two runs pass-interleaved (one pass of each in turn, each timed over its own passes; plain steps
first, then second, alternating by repeat), this times:
  single   eval.decoder.plain_steps against speculative_steps with the head's drafter (DeferredSync, as
           eval.run wraps it) under an AdaptivePolicy whose prior says the head never helps and that never
           re-probes: every pass drafts nothing, so the head never runs, but the target pass still captures
           the head's layers (the features the head catches up on when it drafts again)
  batch B  eval.batch.BatchRun plain against the same head + n-gram hybrid under eval.policy.LoadAware
           with a cost surface on which no draft pays (T(B, n) = n * T(B, 1)): every pass gated to plain
Reported per setting: seconds per pass (decode time / passes, median over repeats) of both, the median of
the per-repeat ratios (`off_vs_plain`, the bound is 1.01) with their range, and whether the tokens are
identical. Interleaving puts a machine's drift on both runs alike; the drafting-off pass is also taken apart
into what it adds: the seconds per pass outside the target's
forward (drafting, gating, commits, bookkeeping) of both runs, and the forward with the head's capture
against the forward without it, timed pass by pass alternately. Without --head a fresh head of --config's
family and shape (default configs/smollm2-135m.yaml: EAGLE-3) is built on the target (its weights do not matter
for a drafting-off pass, which never drafts, nor for --together's seconds, which draft the same rows either way).

JSON keys: threads, target, head, new_tokens, rows: [{setting, batch_size, plain_pass_ms, off_pass_ms,
off_vs_plain, off_vs_plain_range, identical, drafted_tokens, plain_outside_ms, off_outside_ms: seconds per pass
outside the target's forward, the drafting-off pass's own bookkeeping without the forward's noise, and
loop_vs_plain: 1 + (off_outside - plain_outside) / plain pass, the share of off_vs_plain that bookkeeping
explains}], capture: [{batch_size, plain_forward_ms, capture_forward_ms, capture_vs_plain}]: the forward with
and without the head's capture, timed pass by pass alternately (what remains of a drafting-off pass inside
the forward, at the prompts' context).

`--together` runs only this: at a fixed k, the head's batched decoding with the rows' drafts made and their
commits settled together (the family's draft_together / settle_together: EAGLE's one head pass per depth and one
per commit for the whole batch, DFlash's one block pass and one context projection, Medusa's one pass of each
head, MTP's one pass of each step's module) against the same rows drafting and committing one after another (the before: BatchRun(together=False)),
and plain, the three pass-interleaved, per batch size and repeat. JSON key together:
[{batch_size, k, plain_tok_s, together_tok_s, alone_tok_s, together_vs_plain, alone_vs_plain (medians of the
per-repeat ratios), identical}].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from data.cli import UserError, cli_main  # noqa: E402
from data.config import TargetConfig, load_config  # noqa: E402
from data.kvcache import timed_pass  # noqa: E402
from data.regenerate import render_rows  # noqa: E402
from data.target import load_target  # noqa: E402
from eval.batch import BatchRun, SharedPrefill, interleave_batches  # noqa: E402
from eval.costs import DRAFT_DTYPES, DraftCost, VerifyCost, context_cache, place_head  # noqa: E402
from eval.decoder import interleave, plain_steps, speculative_steps  # noqa: E402
from eval.drafters import DeferredSync, HybridDrafter  # noqa: E402
from eval.policy import AdaptivePolicy, LoadAware  # noqa: E402
from heads import registry  # noqa: E402
from heads.base import load_head  # noqa: E402

PROMPTS = ["Explain how a hash map handles collisions.", "Write a short poem about autumn rain.",
           "What is 17 times 23? Show your steps.", "Summarize the plot of a heist movie in three sentences."]


def _never(sources: tuple[str, ...]) -> AdaptivePolicy:
    """A real AdaptivePolicy that prices every draft out (prior acceptance 0) and never re-probes."""
    verify = VerifyCost({1: 1.0, 2: 2.0}, context_len=0)
    return AdaptivePolicy(verify, {s: DraftCost(0.0, 0.0) for s in sources}, {s: [0.0] for s in sources},
                          probe_every=10**9)


def _single(model, ids, make_head, n: int, first_plain: bool) -> tuple[float, float, bool, int, tuple]:
    """(plain seconds per pass, drafting-off seconds per pass, identical, drafted tokens, (plain, drafting-off)
    seconds per pass outside the target's forward) for one prompt, the two pass-interleaved
    (eval.decoder.interleave), the first one alternating between repeats."""
    runs = [plain_steps(model, ids, n),
            speculative_steps(model, ids, DeferredSync(make_head()), 0, n, policy=_never(("draft",)))]
    (plain_ids, ps), (off_ids, os_) = _ordered(interleave, runs, first_plain)
    return (ps.decode_time_s / ps.target_passes, os_.decode_time_s / os_.target_passes,
            bool(torch.equal(plain_ids, off_ids)), os_.drafted_tokens,
            tuple((st.decode_time_s - st.forward_time_s) / st.target_passes for st in (ps, os_)))


def _batched(model, rows, pad, make_head, n: int, first_plain: bool) -> tuple[float, float, bool, int, tuple]:
    """As _single (eval.batch.interleave_batches), with (plain, drafting-off) seconds per pass outside the
    target's forward last."""
    b = len(rows)
    steep = {b: VerifyCost({m: m * 0.05 for m in (1, 2, 4, 8, 17)}, context_len=0)}
    runs = [BatchRun(model, rows, n, pad),
            BatchRun(model, rows, n, pad, k=4, make_drafter=lambda: HybridDrafter(make_head()),
                     make_policy=lambda: _never(("head", "ngram")), load=LoadAware(steep))]
    plain, off = _ordered(interleave_batches, runs, first_plain)
    return (plain.decode_s / plain.passes, off.decode_s / off.passes, bool(torch.equal(plain.tokens, off.tokens)),
            off.stats.drafted_tokens, ((plain.decode_s - plain.forward_s) / plain.passes,
                                       (off.decode_s - off.forward_s) / off.passes))


def _ordered(run_all, runs: list, first_plain: bool) -> list:
    """run_all(runs) with plain stepping first or second (alternating by repeat); results as [plain, off]."""
    if first_plain:
        return run_all(runs)
    return run_all(runs[::-1])[::-1]


def _head_factory(args, io, device, dtype):
    if args.head:
        head, cfg, _ = load_head(args.head, io)
    else:
        cfg = load_config(args.config).head
        # the config's shape, its draft vocabulary (EAGLE-3, DFlash) capped at a smaller target's vocabulary
        if getattr(cfg, "draft_vocab_size", None):
            cfg.draft_vocab_size = min(cfg.draft_vocab_size, io.vocab_size)
        torch.manual_seed(0)
        head = registry.get(cfg.family).build(cfg, io)
    place_head(head, device, dtype, args.draft_dtype)
    return registry.get(cfg.family).drafter_factory(head, io, "auto", 4)


def _measure(name: str, b: int, fn, repeats: int) -> dict:
    plain, off, same, drafted, outside = [], [], True, 0, []
    for r in range(repeats):
        p, o, s, d, x = fn(r)
        plain.append(p)
        off.append(o)
        same, drafted = same and s, drafted + d
        outside.append(x)
    pm, om = statistics.median(plain), statistics.median(off)
    ratios = sorted(o / p for o, p in zip(off, plain))
    # the ratio of each repeat's pair (pass-interleaved), then their median: drift between repeats cancels;
    # the spread of the ratios says how far the machine's noise lets that median be trusted
    row = {"setting": name, "batch_size": b, "plain_pass_ms": 1000 * pm, "off_pass_ms": 1000 * om,
           "off_vs_plain": statistics.median(ratios), "off_vs_plain_range": [ratios[0], ratios[-1]],
           "identical": same, "drafted_tokens": drafted,
           # time outside the target's forward: the bookkeeping a drafting-off pass adds, without its noise
           "plain_outside_ms": 1000 * statistics.median(x[0] for x in outside),
           "off_outside_ms": 1000 * statistics.median(x[1] for x in outside)}
    row["loop_vs_plain"] = 1 + (row["off_outside_ms"] - row["plain_outside_ms"]) / row["plain_pass_ms"]
    return row


def _capture_cost(model, capture, b: int, context: int, pairs: int) -> dict:
    """What a drafting-off pass adds inside the forward: the capture of the head's layers. Two caches of the same
    B rows of `context` random tokens, one capturing; passes timed alternately, one of each per pair (noise
    that drifts over seconds hits both sides of a pair alike), each pass dropped again."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(b)
    ctx = torch.randint(vocab, (b, context), generator=g)
    caches = [context_cache(model, ctx, layers) for layers in (None, capture)]
    ids = torch.randint(vocab, (b, 1), generator=g)
    times: list[list[float]] = [[], []]
    for i in range(pairs + 1):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        dts = {j: timed_pass(caches[j], ids) for j in order}
        if i:  # the first pair warms up
            times[0].append(dts[0])
            times[1].append(dts[1])
    return {"batch_size": b, "plain_forward_ms": 1000 * statistics.median(times[0]),
            "capture_forward_ms": 1000 * statistics.median(times[1]),
            "capture_vs_plain": statistics.median(c / p for p, c in zip(*times))}


def _together(model, rows, pad, make_head, n: int, k: int, repeats: int) -> dict:
    """Fixed-k head rows drafted and committed together, one after another, and plain (see the docstring)."""
    rates: dict[str, list[float]] = {"plain": [], "together": [], "alone": []}
    ratios: dict[str, list[float]] = {"together": [], "alone": []}
    same = True
    shared = SharedPrefill(model, rows, pad)  # decoding alone is timed: every run forks one prefill of the rows
    for r in range(repeats):
        runs = {"plain": BatchRun(model, rows, n, pad, shared=shared),
                "together": BatchRun(model, rows, n, pad, k=k, make_drafter=make_head, shared=shared),
                "alone": BatchRun(model, rows, n, pad, k=k, make_drafter=make_head, together=False, shared=shared)}
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]  # who steps first alternates by repeat
        res = dict(zip(order, interleave_batches([runs[m] for m in order])))
        for m in rates:
            rates[m].append(res[m].tokens_per_s)
        for m in ratios:
            ratios[m].append(res[m].tokens_per_s / res["plain"].tokens_per_s)
            same = same and bool(torch.equal(res[m].tokens, res["plain"].tokens))
    return {"batch_size": len(rows), "k": k, **{f"{m}_tok_s": statistics.median(v) for m, v in rates.items()},
            **{f"{m}_vs_plain": statistics.median(v) for m, v in ratios.items()}, "identical": same}


@cli_main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", help="a head folder (default: a fresh head of --config's family and shape)")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-135m.yaml",
                    help="without --head: the config whose head a fresh head is built from (default: the quickstart's "
                         "EAGLE-3)")
    ap.add_argument("--batch-sizes", default="4,16", help="batched settings (comma-separated)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                    help="the dtype the head drafts in (eval.draft_dtype)")
    ap.add_argument("--together", action="store_true",
                    help="only the fixed-k head's rows drafted and committed together against one after another")
    ap.add_argument("--k", type=int, default=3, help="--together's fixed draft length")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--batch-sizes: comma-separated integers, got '{args.batch_sizes}'") from None
    if args.new_tokens < 2 or args.repeats < 1 or any(b < 1 for b in sizes):
        raise UserError("--new-tokens must be >= 2, --repeats and every batch size >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, io = load_target(TargetConfig(name_or_path=args.target), decode=True, verify=True)
    p = next(model.parameters())
    make_head = _head_factory(args, io, p.device, p.dtype)
    rows = render_rows(tok, [[{"role": "user", "content": t}] for t in PROMPTS])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n = args.new_tokens
    if args.together:
        return _together_table(args, model, rows, pad, make_head, sizes)
    results = [_measure("single stream", 1, lambda r: _single(model, torch.tensor([rows[r % len(rows)]], device=p.device),
                                                              make_head, n, r % 2 == 0), args.repeats)]
    for b in sizes:
        batch = [rows[i % len(rows)] for i in range(b)]
        results.append(_measure(f"batch {b}, load-aware", b, lambda r, batch=batch: _batched(model, batch, pad, make_head, n, r % 2 == 0),
                                args.repeats))
    capture = make_head().capture_layers
    forwards = [_capture_cost(model, capture, b, len(rows[0]), 8 * args.repeats) for b in [1, *sizes]]
    print(f"target {args.target}, head {_head_name(args)} (never drafts), {torch.get_num_threads()} "
          f"threads, {n} new tokens per row, median of {args.repeats}")
    print("| setting | plain ms/pass | drafting off ms/pass | off / plain (range) | outside the forward ms/pass, "
          "plain / off | of which the loop | identical | drafted tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        lo, hi = r["off_vs_plain_range"]
        print(f"| {r['setting']} | {r['plain_pass_ms']:.1f} | {r['off_pass_ms']:.1f} | {r['off_vs_plain']:.3f}x "
              f"({lo:.2f}-{hi:.2f}) | {r['plain_outside_ms']:.2f} / {r['off_outside_ms']:.2f} | "
              f"{r['loop_vs_plain']:.3f}x | {'yes' if r['identical'] else 'NO'} | {r['drafted_tokens']} |")
    print("\n| batch | forward ms, plain | with the head's capture | capture / plain (pass by pass) |")
    print("|---|---|---|---|")
    for f in forwards:
        print(f"| {f['batch_size']} | {f['plain_forward_ms']:.1f} | {f['capture_forward_ms']:.1f} | "
              f"{f['capture_vs_plain']:.3f}x |")
    out = {"threads": torch.get_num_threads(), "target": args.target, "head": _head_name(args), "new_tokens": n,
           "rows": results, "capture": forwards}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


def _head_name(args) -> str:
    return str(args.head) if args.head else f"fresh, of {args.config.name}"


def _together_table(args, model, rows, pad, make_head, sizes: list[int]) -> dict:
    if args.k < 1:
        raise UserError("--k must be >= 1")
    table = [_together(model, [rows[i % len(rows)] for i in range(b)], pad, make_head, args.new_tokens, args.k,
                       args.repeats) for b in sizes]
    print(f"target {args.target}, head {_head_name(args)}, {torch.get_num_threads()} threads, "
          f"{args.new_tokens} new tokens per row, k {args.k}, median of {args.repeats}")
    print("| batch | plain tok/s | together tok/s | one after another tok/s | together / plain | "
          "one after another / plain | identical |")
    print("|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['batch_size']} | {t['plain_tok_s']:.1f} | {t['together_tok_s']:.1f} | {t['alone_tok_s']:.1f} | "
              f"{t['together_vs_plain']:.3f}x | {t['alone_vs_plain']:.3f}x | {'yes' if t['identical'] else 'NO'} |")
    out = {"threads": torch.get_num_threads(), "target": args.target, "head": _head_name(args),
           "new_tokens": args.new_tokens, "together": table}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
