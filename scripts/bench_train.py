"""Training throughput of the shared loop on SmolLM2-135M: EAGLE-1 and EAGLE-3, offline store and online.

    .venv/bin/python scripts/bench_train.py --json out.json            # ~5 minutes on 2 CPU cores
    .venv/bin/python scripts/bench_train.py --steps 20 --config configs/smollm2-135m.yaml

Each case is a separate process running train.loop.train on the bundled tiny conversations tokenized for
SmolLM2 (no regeneration needed) with the config's head settings (draft vocab capped by what those
conversations contain), so its peak RSS is its own. Offline cases first extract a store once with
`python -m data.extract`. tokens/s counts real (unpadded) tokens per second of training steps, averaged
over the logged windows after the first (the first holds start-up costs). Prints a table; --json writes
a list of {head, features, tokens_per_s, peak_rss_mb, steps, draft_vocab, ttt_length}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from data.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]
DATA = "data/bundled/tiny_conversations.jsonl"


def child(args: argparse.Namespace) -> None:
    """Run one case in this process and print its JSON result on the last line."""
    from data.config import load_config
    from train.loop import train

    cfg = load_config(args.config, args.override)
    cfg.out = args.out
    train(cfg)
    rows = [json.loads(x) for x in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows if r["event"] == "train"][1:]
    print(json.dumps({"tokens_per_s": sum(tps) / max(len(tps), 1),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_case(config: str, out: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", "--config", config, "--out", str(out), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode != 0:
        raise SystemExit(f"case failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per case")
    p.add_argument("--draft-vocab", type=int, default=512, help="EAGLE-3 draft vocab (the bundled data is small)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    args.override = rest
    if args.child:
        child(args)
        return
    common = [f"--data.path={DATA}", "--data.max_length=512", f"--train.max_steps={args.steps}",
              "--train.log_every=2", "--train.eval_every=100000", "--train.checkpoint_every=100000",
              "--logging.wandb_mode=disabled", "--data.holdout_fraction=0.05"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        store_cfg = Path(tmp) / "store"
        for family in ("eagle1", "eagle3"):
            # EAGLE-1's head section has other keys than the config's EAGLE-3 one: replace it whole
            head = ["--head={family: eagle1}"] if family == "eagle1" else [
                "--head.family=eagle3", f"--head.draft_vocab_size={args.draft_vocab}"]
            for mode in ("offline", "online"):
                feats = [f"--features.mode={mode}", f"--features.store={store_cfg / family}"]
                out = Path(tmp) / f"{family}-{mode}"
                if mode == "offline":
                    ext = subprocess.run([sys.executable, "-m", "data.extract", "--config", args.config, "--out", str(out),
                                          *common, *head, *feats], cwd=ROOT, capture_output=True, text=True)
                    if ext.returncode != 0:
                        raise SystemExit(f"extraction failed:\n{ext.stderr[-3000:]}")
                r = run_case(args.config, out, [*common, *head, *feats])
                from data.config import load_config

                cfg = load_config(args.config, [*common, *head])
                results.append({"head": family, "features": mode, "tokens_per_s": round(r["tokens_per_s"], 1),
                                "peak_rss_mb": round(r["peak_rss_mb"], 1), "steps": args.steps,
                                "batch_size": cfg.train.batch_size,
                                "draft_vocab": getattr(cfg.head, "draft_vocab_size", None),
                                "ttt_length": getattr(cfg.head, "ttt_length", None)})
                print(f"{family:7s} {mode:8s} {results[-1]['tokens_per_s']:10.1f} tok/s "
                      f"{results[-1]['peak_rss_mb']:9.1f} MB", flush=True)
    print(f"\n{'head':8s}{'features':10s}{'tokens/s':>10s}{'peak RSS MB':>13s}  (target {args.config}, "
          f"{args.steps} steps, batch {results[0]['batch_size']})")
    for r in results:
        print(f"{r['head']:8s}{r['features']:10s}{r['tokens_per_s']:10.1f}{r['peak_rss_mb']:13.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
