"""Benchmark response regeneration: batched data.regenerate vs one-prompt-at-a-time `model.generate`.

For each batch size, runs the real regeneration pipeline (python -m data.regenerate's code: the target loaded
as it loads it, chat template, left-padded batches, EOS stopping, JSONL writes with fsync) on the same greedy
prompts and compares its generated tokens/s with a baseline that calls `model.generate` on one prompt at a
time (torch's dense kernels). Tokens are counted the same way in both: each answer's tokens up to and
including its EOS (or max_new_tokens). --kernels repeats the rows for each `target.cpu_kernels` (data.packed)
on a target loaded with it: `packed,dense` compares oneDNN's prepacked matrices with torch's own in one run.

    python scripts/bench_regenerate.py --json bench_regenerate.json            # SmolLM2-135M, CPU, ~2-4 min
    python scripts/bench_regenerate.py --batches 32 --num-prompts 64 --kernels packed,dense
    python scripts/bench_regenerate.py --target tiny-random-llama --num-prompts 4 --max-new-tokens 8
    python scripts/bench_regenerate.py --engine vllm --num-prompts 64 --json vllm.json  # the vllm extra

--engine vllm compares the two engines of data.regenerate instead: transformers' batched generate (batch
--hf-batch, default 8) and vLLM (all prompts in one chunk, vLLM batches them itself), same prompts, same
greedy settings, same token count; JSON {"setup", "hf_tokens_per_s", "vllm_tokens_per_s", "vllm_over_hf",
"answers_equal"} (greedy answers identical between the engines; float kernels differ, so near-ties can
flip an answer). vLLM's start-up (engine processes, weights, memory profiling) is not timed.

Prints a table and writes JSON {"setup": {...}, "rows": [{"kernels", "batch", "tokens_per_s",
"baseline_tokens_per_s", "ratio", ...}, ...]}; `answers_equal_baseline` counts batched answers identical to
the one-at-a-time greedy answer (float rounding under padding can flip a near-tie; 1-at-a-time should match).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from data.cli import cli_main  # noqa: E402
from data.config import RunConfig, TargetConfig  # noqa: E402
from data.readers import read_records  # noqa: E402
from data.regenerate import eos_ids, make_jobs, regenerate, render_rows  # noqa: E402
from data.target import load_model, load_tokenizer  # noqa: E402


def baseline(model, tok, prompts: list[str], max_new_tokens: int) -> tuple[list[str], int, float]:
    """One `model.generate` call per prompt (no padding): (answers, generated tokens, seconds)."""
    eos = eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    answers, tokens = [], 0
    start = time.perf_counter()
    for p in prompts:
        ids = torch.tensor(render_rows(tok, [[{"role": "user", "content": p}]]))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)
        new = out[0, ids.shape[1]:].tolist()
        stop = next((j for j, t in enumerate(new) if t in eos), None)
        tokens += len(new) if stop is None else stop + 1
        answers.append(tok.decode(new if stop is None else new[:stop], skip_special_tokens=True).strip())
    return answers, tokens, time.perf_counter() - start


def _plain_prompts(tmp: str, jobs, prompts: list[str]) -> Path:
    """First user turns only, so both sides answer the same prompts."""
    plain = Path(tmp) / "prompts.jsonl"
    plain.write_text("".join(json.dumps({"id": j.id, "prompt": p}) + "\n" for j, p in zip(jobs, prompts)))
    return plain


def _warm_prompt(plain: Path) -> Path:
    """The first prompt alone, beside `plain`: a warm-up run (first-call allocations), not timed."""
    one = plain.with_name("one.jsonl")
    one.write_text(plain.read_text().splitlines(keepends=True)[0])
    return one


def _regen_cfg(tcfg: TargetConfig, out: str, prompts: Path, batch: int, max_new_tokens: int,
               engine: str = "hf") -> RunConfig:
    cfg = RunConfig()
    cfg.target = tcfg
    cfg.out = out
    r = cfg.regenerate
    r.prompts, r.num_prompts, r.batch_size, r.max_new_tokens, r.engine = str(prompts), None, batch, max_new_tokens, engine
    return cfg


def engines(args: argparse.Namespace, tcfg: TargetConfig, jobs, prompts: list[str]) -> dict:
    """transformers (batched generate) against vLLM on the same prompts: tokens/s of each and the ratio."""
    from data.regenerate import load_engine

    with tempfile.TemporaryDirectory() as tmp:
        plain = _plain_prompts(tmp, jobs, prompts)
        one = _warm_prompt(plain)
        hf_cfg = _regen_cfg(tcfg, os.path.join(tmp, "hf"), plain, args.hf_batch, args.max_new_tokens)
        model, tok, _ = load_engine(hf_cfg)
        regenerate(_regen_cfg(tcfg, os.path.join(tmp, "warm"), one, 1, 4), model, tok)
        hf = regenerate(hf_cfg, model, tok)
        del model
        v_cfg = _regen_cfg(tcfg, os.path.join(tmp, "vllm"), plain, len(prompts), args.max_new_tokens, "vllm")
        target, tok, _ = load_engine(v_cfg)
        regenerate(_regen_cfg(tcfg, os.path.join(tmp, "vwarm"), one, 1, 4, "vllm"), target, tok)
        vl = regenerate(v_cfg, target, tok)
        a = read_records(hf["output"], "sharegpt")[0]
        b = read_records(vl["output"], "sharegpt")[0]
        same = sum(x.messages[-1]["content"] == y.messages[-1]["content"] for x, y in zip(a, b))
    return {"setup": {"target": args.target, "prompts": args.prompts, "num_prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "greedy": True, "hf_batch": args.hf_batch,
                      "vllm_chunk": len(prompts), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                      "hf_tokens": hf["generated_tokens"], "hf_seconds": hf["seconds"],
                      "vllm_tokens": vl["generated_tokens"], "vllm_seconds": vl["seconds"]},
            "hf_tokens_per_s": hf["tokens_per_s"], "vllm_tokens_per_s": vl["tokens_per_s"],
            "vllm_over_hf": vl["tokens_per_s"] / hf["tokens_per_s"], "answers_equal": same}


@cli_main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="target name_or_path (default: smollm2-135m)")
    ap.add_argument("--prompts", default="data/bundled/gsm8k_train.jsonl")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); 1 is steadier "
                    "on a machine shared with other jobs, where idle threads spin-wait")
    ap.add_argument("--kernels", default="auto", help="comma-separated target.cpu_kernels to run the batches with "
                    "(auto, packed, skinny, dense; default auto, what data.regenerate runs)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                    help="vllm: transformers' batched generate against vLLM instead (the vllm extra)")
    ap.add_argument("--hf-batch", type=int, default=8, help="--engine vllm: transformers' batch size (default 8)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    tcfg = TargetConfig(name_or_path=args.target, device=args.device)
    kernels = args.kernels.split(",")
    if bad := [k for k in kernels if k not in ("auto", "packed", "skinny", "dense")]:
        ap.error(f"--kernels: {bad[0]!r} is not auto, packed, skinny or dense")
    records, _ = read_records(args.prompts, max_samples=args.num_prompts)
    jobs, _ = make_jobs(records, None)
    prompts = [j.users[0] for j in jobs]
    if args.engine == "vllm":
        res = engines(args, tcfg, jobs, prompts)
        st = res["setup"]
        print(f"regeneration engines: {args.target}, {len(prompts)} prompts, greedy, <= {args.max_new_tokens} new "
              f"tokens, {st['cpus']} CPUs")
        print(f"{'engine':>22} | {'tokens/s':>9} | {'tokens':>6} | seconds")
        print(f"{'transformers batch ' + str(args.hf_batch):>22} | {res['hf_tokens_per_s']:>9.1f} | "
              f"{st['hf_tokens']:>6} | {st['hf_seconds']:.1f}")
        print(f"{'vllm':>22} | {res['vllm_tokens_per_s']:>9.1f} | {st['vllm_tokens']:>6} | {st['vllm_seconds']:.1f}")
        print(f"vllm_over_hf {res['vllm_over_hf']:.2f}; identical answers {res['answers_equal']}/{len(prompts)}")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
            print(f"wrote {args.json}")
        return
    model, tok = load_model(tcfg), load_tokenizer(tcfg)

    # warm-up (first-call allocations and kernel selection), not timed
    baseline(model, tok, prompts[:1], 4)
    base_answers, base_tokens, base_s = baseline(model, tok, prompts, args.max_new_tokens)
    base_tps = base_tokens / base_s
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plain = _plain_prompts(tmp, jobs, prompts)
        one = _warm_prompt(plain)
        for kind in kernels:
            kcfg = TargetConfig(**{**vars(tcfg), "cpu_kernels": kind})
            gen = load_model(kcfg, decode=True)  # as data.regenerate loads it
            regenerate(_regen_cfg(kcfg, os.path.join(tmp, f"warm-{kind}"), one, 1, 4), gen, tok)
            for b in args.batches:
                s = regenerate(_regen_cfg(kcfg, os.path.join(tmp, f"{kind}-b{b}"), plain, b, args.max_new_tokens),
                               gen, tok)
                got, _ = read_records(s["output"], "sharegpt")
                same = sum(g.messages[-1]["content"] == a for g, a in zip(got, base_answers))
                rows.append({"kernels": kind, "batch": b, "tokens_per_s": s["tokens_per_s"],
                             "baseline_tokens_per_s": base_tps, "ratio": s["tokens_per_s"] / base_tps,
                             "prompts_per_s": s["prompts_per_s"], "tokens": s["generated_tokens"],
                             "seconds": s["seconds"], "answers_equal_baseline": same})
            del gen
    setup = {"target": args.target, "device": args.device, "torch_threads": torch.get_num_threads(),
             "prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
             "baseline_tokens": base_tokens, "baseline_seconds": base_s}

    print(f"regeneration throughput: {args.target} on {args.device}, {len(prompts)} prompts, greedy, "
          f"<= {args.max_new_tokens} new tokens ({torch.get_num_threads()} threads)")
    print(f"{'kernels':>7} | {'batch':>5} | {'tokens/s':>9} | {'baseline tok/s':>14} | {'ratio':>6} | "
          f"{'prompts/s':>9} | {'tokens':>6} | same answers")
    for row in rows:
        print(f"{row['kernels']:>7} | {row['batch']:>5} | {row['tokens_per_s']:>9.1f} | "
              f"{row['baseline_tokens_per_s']:>14.1f} | {row['ratio']:>6.2f} | {row['prompts_per_s']:>9.3f} | {row['tokens']:>6} | "
              f"{row['answers_equal_baseline']}/{len(prompts)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
