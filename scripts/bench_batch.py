"""Benchmark what a pass that drafts nothing costs against a plain pass, single stream and batched (CPU or GPU).

    python scripts/bench_batch.py --head runs/quickstart/head --json out.json --threads 1
    python scripts/bench_batch.py --batch-sizes 1,4,16 --new-tokens 48 --repeats 5   # a fresh EAGLE-3 head
    python scripts/bench_batch.py --head runs/quickstart/head --together --k 3 --threads 0   # only the table below
    python scripts/bench_batch.py --config configs/smollm2-135m-dflash.yaml --together --k 3   # a fresh DFlash head

Where the policy turns drafting off, speculative decoding must cost what plain decoding costs. Per prompt and
repeat, three runs pass-interleaved (one pass of each per cycle in a fresh order, each timed over its own passes;
which run is set up, prefilled and listed first rotates by repeat): plain, a control that is plain again, and
the drafting-off run. This times:
  single   eval.decoder.plain_steps against speculative_steps with the head's drafter (DeferredSync, as
           eval.run wraps it) under an AdaptivePolicy whose prior says the head never helps and that never
           re-probes: every pass drafts nothing, so the head never runs, but the target pass still captures
           the head's layers (the features the head catches up on when it drafts again)
  batch B  eval.batch.BatchRun plain against the same head + n-gram hybrid under eval.policy.LoadAware
           with a cost surface on which no draft pays (T(B, n) = n * T(B, 1)): every pass gated to plain
Reported per setting: seconds per pass (decode time / passes, median over repeats) of each; off / plain (the
bound is 1.01) two ways: `off_vs_plain_paired`, the median over every pass of its ratio to plain's pass of the
same cycle (hundreds of pairs, the tighter), and `off_vs_plain`, the median of the per-repeat ratios with their
range; the same two for the control (`control_vs_plain*`: what the machine's noise and the runs' order alone
read as a ratio; with the runs always built in one order, plain against plain read 1.011x at batch 4 in 5
repeats, all five above 1); and whether the tokens are identical. Interleaving puts a machine's drift on all
runs alike. The drafting-off pass is also taken apart into what it adds: the seconds per pass outside the
target's forward (drafting, gating, commits, bookkeeping) of it and plain, and the forward with the head's
capture against the forward without it, timed pass by pass alternately. Without --head a fresh head of --config's
family and shape (default configs/smollm2-135m.yaml: EAGLE-3) is built on the target (its weights do not matter
for a drafting-off pass, which never drafts, nor for --together's seconds, which draft the same rows either way).

JSON keys: threads, target, head, new_tokens, rows: [{setting, batch_size, plain_pass_ms, off_pass_ms,
control_pass_ms, off_vs_plain_paired, off_vs_plain, off_vs_plain_range, control_vs_plain_paired,
control_vs_plain, control_vs_plain_range, identical, drafted_tokens, plain_outside_ms, off_outside_ms: seconds per
pass outside the target's forward, the drafting-off pass's own bookkeeping without the forward's noise, and
loop_vs_plain: 1 + (off_outside - plain_outside) / plain pass, the share of off_vs_plain that bookkeeping
explains}], capture: [{batch_size, plain_forward_ms, capture_forward_ms, capture_vs_plain}]: the forward with
and without the head's capture on one cache, timed pass by pass alternately (what remains of a drafting-off pass
inside the forward, at the prompts' context).

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
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from data.cli import UserError, cli_main  # noqa: E402
from data.config import TargetConfig, load_config  # noqa: E402
from data.features import FeatureCapture  # noqa: E402
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


class _Run(NamedTuple):
    """One run of one repeat: seconds per pass, of which outside the target's forward, its tokens, the tokens it
    drafted, and each pass's seconds."""

    pass_s: float
    outside_s: float
    tokens: torch.Tensor
    drafted: int
    passes: list[float]


def _single(model, ids, make_head, n: int, r: int) -> dict:
    """One prompt's plain, control (plain again) and drafting-off runs, pass-interleaved (eval.decoder.interleave),
    started in an order rotated by the repeat r: a _Run per run."""
    passes: dict[str, list[float]] = {"plain": [], "control": [], "off": []}
    makers = {"plain": lambda: _timed_steps(plain_steps(model, ids, n), passes["plain"]),
              "control": lambda: _timed_steps(plain_steps(model, ids, n), passes["control"]),
              "off": lambda: _timed_steps(speculative_steps(model, ids, DeferredSync(make_head()), 0, n,
                                                            policy=_never(("draft",))), passes["off"])}
    out = {}
    for name, (tokens, st) in _rotated(interleave, makers, r).items():
        out[name] = _Run(st.decode_time_s / st.target_passes, (st.decode_time_s - st.forward_time_s) / st.target_passes,
                         tokens, st.drafted_tokens, passes[name][1:])  # the first step is the prefill
    return out


def _batched(model, rows, pad, make_head, n: int, r: int) -> dict:
    """As _single for a batch (eval.batch.BatchRun, eval.batch.interleave_batches); each run its own prefill."""
    b = len(rows)
    steep = {b: VerifyCost({m: m * 0.05 for m in (1, 2, 4, 8, 17)}, context_len=0)}
    makers = {"plain": lambda: _TimedRun(BatchRun(model, rows, n, pad)),
              "control": lambda: _TimedRun(BatchRun(model, rows, n, pad)),
              "off": lambda: _TimedRun(BatchRun(model, rows, n, pad, k=4, make_drafter=lambda: HybridDrafter(make_head()),
                                                make_policy=lambda: _never(("head", "ngram")), load=LoadAware(steep)))}
    out = {}
    for name, (res, seconds) in _rotated(interleave_batches, makers, r).items():
        out[name] = _Run(res.decode_s / res.passes, (res.decode_s - res.forward_s) / res.passes, res.tokens,
                         res.stats.drafted_tokens, seconds)
    return out


def _timed_steps(steps, seconds: list[float]):
    """The generation `steps` (eval.decoder's plain_steps, speculative_steps), each step's seconds appended to
    `seconds`; returns what it returns."""
    while True:
        t = time.perf_counter()
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        seconds.append(time.perf_counter() - t)
        yield


class _TimedRun:
    """A BatchRun whose passes' seconds are kept one by one; result() is (its result, those seconds)."""

    def __init__(self, run: BatchRun):
        self.run, self.seconds = run, []

    @property
    def done(self) -> bool:
        return self.run.done

    def step(self) -> None:
        t = time.perf_counter()
        self.run.step()
        self.seconds.append(time.perf_counter() - t)

    def result(self) -> tuple:
        return self.run.result(), self.seconds


def _rotated(run_all, makers: dict, r: int) -> dict:
    """run_all over the runs `makers` build, built and listed in an order rotated by the repeat r (which run is
    set up, prefilled and first in the cycle order changes between repeats); results by name."""
    names = list(makers)
    names = names[r % len(names):] + names[:r % len(names)]
    runs = [makers[m]() for m in names]
    return dict(zip(names, run_all(runs)))


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
    """fn(r) per repeat r (_single or _batched: a _Run by name); the row of the table."""
    reps = [fn(r) for r in range(repeats)]
    ms = {m: 1000 * statistics.median(x[m].pass_s for x in reps) for m in ("plain", "off", "control")}
    # the ratio of each repeat's runs (pass-interleaved), then their median: drift between repeats cancels; the
    # control (plain against plain, the same way) is what the machine's noise alone reads as a ratio
    ratios = {m: sorted(x[m].pass_s / x["plain"].pass_s for x in reps) for m in ("off", "control")}
    # pass against pass of the same cycle (the runs take the same passes: drafting off, identical tokens): a
    # repeat's ratio averages its passes' noise once, these pairs are hundreds of samples of it
    paired = {m: statistics.median(a / b for x in reps for a, b in zip(x[m].passes, x["plain"].passes))
              for m in ("off", "control")}
    row = {"setting": name, "batch_size": b, "plain_pass_ms": ms["plain"], "off_pass_ms": ms["off"],
           "control_pass_ms": ms["control"],
           "off_vs_plain": statistics.median(ratios["off"]), "off_vs_plain_range": [ratios["off"][0], ratios["off"][-1]],
           "control_vs_plain": statistics.median(ratios["control"]),
           "control_vs_plain_range": [ratios["control"][0], ratios["control"][-1]],
           "off_vs_plain_paired": paired["off"], "control_vs_plain_paired": paired["control"],
           "identical": all(torch.equal(x["plain"].tokens, x[m].tokens) for x in reps for m in ("off", "control")),
           "drafted_tokens": sum(x["off"].drafted for x in reps),
           # time outside the target's forward: the bookkeeping a drafting-off pass adds, without its noise
           "plain_outside_ms": 1000 * statistics.median(x["plain"].outside_s for x in reps),
           "off_outside_ms": 1000 * statistics.median(x["off"].outside_s for x in reps)}
    row["loop_vs_plain"] = 1 + (row["off_outside_ms"] - row["plain_outside_ms"]) / row["plain_pass_ms"]
    return row


def _capture_cost(model, capture, b: int, context: int, pairs: int) -> dict:
    """What a drafting-off pass adds inside the forward: the capture of the head's layers (its hooks around the
    pass and the features' concatenation, as DynamicKV does it). One cache of B rows of `context` random tokens,
    its passes with and without the capture timed alternately, one of each per pair (noise that drifts over
    seconds hits both sides of a pair alike), each pass dropped again. One cache, not a capturing and a plain
    one: two caches of the same rows can differ by about 1% between themselves (docs/batching.md)."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(b)
    kv = context_cache(model, torch.randint(vocab, (b, context), generator=g))
    ids = torch.randint(vocab, (b, 1), generator=g)
    cap = FeatureCapture(model, capture)

    def captured() -> float:
        t = time.perf_counter()
        with cap:
            kv.run(ids)
        cap.features()
        dt = time.perf_counter() - t
        kv.keep([])
        return dt

    times: list[list[float]] = [[], []]
    for i in range(pairs + 1):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        dts = {j: captured() if j else timed_pass(kv, ids) for j in order}
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
        makers = {"plain": lambda: BatchRun(model, rows, n, pad, shared=shared),
                  "together": lambda: BatchRun(model, rows, n, pad, k=k, make_drafter=make_head, shared=shared),
                  "alone": lambda: BatchRun(model, rows, n, pad, k=k, make_drafter=make_head, together=False,
                                            shared=shared)}
        res = _rotated(interleave_batches, makers, r)
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
                                                              make_head, n, r), args.repeats)]
    for b in sizes:
        batch = [rows[i % len(rows)] for i in range(b)]
        results.append(_measure(f"batch {b}, load-aware", b, lambda r, batch=batch: _batched(model, batch, pad, make_head, n, r),
                                args.repeats))
    capture = make_head().capture_layers
    forwards = [_capture_cost(model, capture, b, len(rows[0]), 8 * args.repeats) for b in sorted({1, *sizes})]
    print(f"target {args.target}, head {_head_name(args)} (never drafts), {torch.get_num_threads()} "
          f"threads, {n} new tokens per row, median of {args.repeats}")
    print("| setting | plain ms/pass | drafting off ms/pass | off / plain: pass by pass; per repeat (range) | "
          "control, plain / plain: pass by pass; per repeat (range) | outside the forward ms/pass, plain / off | "
          "of which the loop | identical | drafted tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lo, hi = r["off_vs_plain_range"]
        clo, chi = r["control_vs_plain_range"]
        print(f"| {r['setting']} | {r['plain_pass_ms']:.1f} | {r['off_pass_ms']:.1f} | "
              f"{r['off_vs_plain_paired']:.3f}x; {r['off_vs_plain']:.3f}x ({lo:.2f}-{hi:.2f}) | "
              f"{r['control_vs_plain_paired']:.3f}x; {r['control_vs_plain']:.3f}x ({clo:.2f}-{chi:.2f}) | "
              f"{r['plain_outside_ms']:.2f} / {r['off_outside_ms']:.2f} | "
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
