"""Benchmark a verify pass under transformers' sdpa attention against data.attention's grouped one, per context.

    python scripts/bench_attention.py                                  # SmolLM2-135M, contexts 100-1000
    python scripts/bench_attention.py --contexts 300,700 --repeats 20 --json out.json

For each context length the target (loaded as the eval loads it: `load_target(decode=True, verify=True)`, CPU
kernels chosen by `target.cpu_kernels: auto`) holds that many random tokens in its KV cache; then passes over
1, 2 and 4 new tokens (a plain step, a chain of 1 and 3 drafted tokens: the passes that need a mask) are
timed under both attentions, interleaved (round r times every attention and width once), and the medians
printed as a table. Nothing is kept: each timed pass is dropped from the cache again. JSON:
{"<context>": {"<attention>": {"<tokens>": ms}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from data.attention import NAME  # noqa: E402
from data.cli import cli_main, number_arg  # noqa: E402
from data.config import TargetConfig  # noqa: E402
from data.kvcache import new_kv  # noqa: E402
from data.target import load_target  # noqa: E402

WIDTHS = (1, 2, 4)  # tokens per pass: a plain step, then one and three drafted tokens


def bench(model: torch.nn.Module, context: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of a pass over each width at this context, under sdpa and the grouped attention."""
    gen = torch.Generator().manual_seed(context)
    kv = new_kv(model, "dynamic")
    kv.run(torch.randint(100, 20000, (1, context), generator=gen), logits_to_keep=1)
    kv.keep(range(context))
    times: dict[str, dict[int, list[float]]] = {a: {w: [] for w in WIDTHS} for a in ("sdpa", NAME)}
    with torch.inference_mode():
        for r in range(repeats + 2):  # two warm-up rounds, not kept
            for attention in times:
                model.set_attn_implementation(attention)
                for w in WIDTHS:
                    ids = torch.randint(100, 20000, (1, w), generator=gen)
                    t = time.perf_counter()
                    kv.run(ids, torch.arange(-1, w - 2) if w > 1 else None)
                    kv.keep([])
                    if r >= 2:
                        times[attention][w].append((time.perf_counter() - t) * 1000)
    model.set_attn_implementation(NAME)
    return {a: {w: statistics.median(v) for w, v in per.items()} for a, per in times.items()}


@cli_main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="target name or path (default smollm2-135m)")
    ap.add_argument("--contexts", type=number_arg("--contexts", many=True), default=[100, 300, 600, 1000],
                    help="context lengths, comma-separated (default 100,300,600,1000)")
    ap.add_argument("--repeats", type=number_arg("--repeats"), default=12, help="timed rounds per context")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _, _ = load_target(TargetConfig(name_or_path=args.target, device="cpu"), decode=True, verify=True)
    if model.config.get_text_config()._attn_implementation != NAME:
        raise SystemExit(f"{args.target}: not switched to {NAME} (no grouped key/value heads, or not sdpa)")
    out: dict[str, dict[str, dict[int, float]]] = {}
    print("| context | " + " | ".join(f"{a}: T({' / '.join(map(str, WIDTHS))}) ms" for a in ("sdpa", NAME)) + " |")
    print("|---|---|---|")
    for context in args.contexts:
        row = out[str(context)] = bench(model, context, args.repeats)
        cells = (" / ".join(f"{row[a][w]:.1f}" for w in WIDTHS) for a in ("sdpa", NAME))
        print(f"| {context} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
