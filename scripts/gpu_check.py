"""One-call GPU check at Llama-3.1-8B shapes with random weights (nothing is downloaded), in one process.

    python scripts/gpu_check.py --json runs/gpu_check.json          # on one GPU (H200: ~2-4 min, budget 8)
    python scripts/gpu_check.py --tiny --json /tmp/gpu_check.json   # the same code on CPU, tiny shapes (< 2 min)
    python scripts/gpu_check.py --only oracle,plain                  # rerun some sections (after the build)

Sections (each timed, budgeted, and recorded with its error instead of stopping the run):
  build        the target built on the device in its dtype directly (bf16): Llama-3.1-8B's architecture
               (hidden 4096, 32 layers, GQA 32/8, MLP 14336, vocab 128256); head settings from
               configs/llama8b.yaml (EAGLE-3, layers [2, 16, 29], draft vocab 32000, TTT 7)
  verify_cost  T(n), the median time of one target forward over n = 1..64 new tokens on a 512-token cache
               (eval.costs.measure_verify_cost): eager (dynamic cache) and static cache (CUDA graphs on CUDA)
  oracle       the speculative decoder with an oracle drafter proposing the target's own greedy continuation,
               so every draft is accepted and tau = k + 1 exactly, k = 1..8, on both caches: time per pass
               against T(k+1) = the decoder's own overhead (drafting is free), tokens/s and speedup vs plain
  plain        plain greedy decoding tokens/s, eager and static (graphs)
  head_train   EAGLE-3 head training steps (TTT 7, draft vocab 32k, bf16 autocast, AdamW) on online features
               of the random target: tokens/s, achieved TFLOP/s and MFU (all FLOPs of a step: the target's
               feature forward, its soft labels and the head's forward + backward) and the head's own MFU
  extract      feature extraction (data.features.forward_features, copied to host memory as the store needs)
               tokens/s against a plain decoder forward over the same batch
  batch_heads  batched decoding (eval.batch, eager dynamic cache) with a random EAGLE-3 head at k = 3, B rows of
               a 128-token prompt: ms per pass of plain, of the rows drafting and committing together
               (EagleDrafter.draft_together / settle_together) and one after another (together=False), the
               three pass-interleaved, B = 1, 4, 16; the head is random (tau about 1), so this is what the
               head's passes add to a batch pass

Writes one JSON (every section's numbers, seconds and error) and a markdown table (`--md`, default: the JSON
path with .md), rewritten after every section, so a run killed midway keeps what it measured; a section not
started 420 s after launch is skipped (`--deadline-s`), so the whole run fits one 10-minute device call. Imports only torch, transformers, pyyaml and project modules that need nothing else (the GPU
image lacks datasets, wandb, gguf and deepspeed; tests/test_gpu_check.py runs `--tiny` with those blocked).
Exit status 2 with one line when no CUDA device is visible without --tiny; 1 when a section failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

T_START = time.perf_counter()  # the deadline and total_s count the imports too
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from data.config import load_config  # noqa: E402
from data.features import forward_features, greedy_ids  # noqa: E402
from data.kvcache import CACHE_KINDS, new_kv  # noqa: E402
from data.target import target_io  # noqa: E402
from eval.batch import BatchRun, interleave_batches  # noqa: E402
from eval.costs import measure_verify_cost, place_head  # noqa: E402
from eval.decoder import plain_generate, speculative_generate  # noqa: E402
from heads import registry  # noqa: E402
from heads.base import DraftTree  # noqa: E402

LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               max_position_embeddings=131072, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, rope_theta=500000.0, rms_norm_eps=1e-5,
            max_position_embeddings=4096, tie_word_embeddings=False)
VERIFY_NS = list(range(1, 65))
ORACLE_KS = list(range(1, 9))
CONTEXT = 512
# Dense bf16 peak (TFLOP/s) by device name; MFU is null for a device not listed (override: --peak-tflops).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
# Seconds each section may take on the full run (8 minutes in all, build and imports included). A section
# not started by DEADLINE_S is skipped, so the run ends inside one 10-minute device call whatever happens.
BUDGET_S = {"build": 60, "verify_cost": 120, "oracle": 90, "plain": 45, "head_train": 60, "extract": 45,
            "batch_heads": 60}
DEADLINE_S = 420.0


# ----------------------------------------------------------------------------------------------- setup
class Settings:
    """The sizes of one run: the full check or its tiny CPU twin (same code, same keys)."""

    def __init__(self, tiny: bool, device: torch.device, cfg_path: Path):
        run = load_config(cfg_path)
        self.tiny, self.device = tiny, device
        self.shapes = TINY if tiny else LLAMA8B
        self.dtype = torch.float32 if tiny else torch.bfloat16
        self.head = run.head
        if tiny:  # 4 layers: the default EAGLE-3 layers of a 4-layer target
            self.head.draft_vocab_size, self.head.layer_ids = 256, None
        self.seq_len = 128 if tiny else run.data.max_length
        self.batch = run.train.batch_size
        self.extract_rows = 2 if tiny else max(run.features.batch_tokens // run.data.max_length, 1)
        self.repeats = 1 if tiny else 5
        self.passes = 4 if tiny else 16  # oracle passes per generation
        self.plain_tokens = 16 if tiny else 256
        self.train_steps = 2 if tiny else 8
        self.batch_sizes = [1, 2] if tiny else [1, 4, 16]
        self.batch_tokens = 4 if tiny else 16  # new tokens per row in batch_heads
        self.budget = {k: (10_000.0 if tiny else v) for k, v in BUDGET_S.items()}
        self.deadline_s = 10_000.0 if tiny else DEADLINE_S


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_target(s: Settings) -> torch.nn.Module:
    """Random weights built on the device in the run's dtype (no fp32 copy on the host)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**s.shapes)
    with torch.device(s.device):
        model = LlamaForCausalLM._from_config(cfg, dtype=s.dtype)
    model.eval().requires_grad_(False)
    return model


def prompt_ids(s: Settings, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(int(s.shapes["vocab_size"]), (1, n), generator=g)


# ----------------------------------------------------------------------------------------------- sections
def section_verify_cost(s: Settings, model: torch.nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {"context_len": CONTEXT, "ns": VERIFY_NS}
    for kind in CACHE_KINDS:
        cost = measure_verify_cost(model, CONTEXT, VERIFY_NS, repeats=s.repeats, cache=kind)
        out[f"{kind}_ms"] = {str(n): round(v * 1000, 4) for n, v in sorted(cost.seconds.items())}
    return out


class OracleDrafter:
    """Proposes the next k tokens of a fixed continuation (chains on the host, no features)."""

    capture_layers = None

    def __init__(self, continuation: list[int]):
        self.ref = continuation
        self.n = 0

    def begin(self, prompt_ids: torch.Tensor, features: Any, next_token: int) -> None:
        self.n = 1

    def draft(self, k: int, temperature: float) -> DraftTree:
        toks = (self.ref[self.n:self.n + k] + [0] * k)[:k]
        return DraftTree.chain(torch.tensor(toks, dtype=torch.long))

    def commit(self, accepted: list[int], features: Any, next_token: int) -> None:
        self.n += len(accepted) + 1


def oracle_run(model: torch.nn.Module, prompt: torch.Tensor, k: int, n_new: int, cache: Any,
               reference: list[int]) -> tuple[Any, list[int]]:
    """A generation whose every draft is accepted: the oracle's continuation is refined until it is a fixed point.

    In bf16 a verify over k+1 rows can round differently from one-row decoding, so the plain greedy text is only
    the first guess; each round replaces it with the decoder's own output (at most 4 rounds, usually one).
    """
    ref = reference
    for _ in range(4):
        out, st = speculative_generate(model, prompt, OracleDrafter(ref), k, n_new, cache=cache)
        if st.tau == k + 1 and out.tolist() == ref[:n_new]:
            break
        ref = out.tolist()
    return st, ref


def section_oracle(s: Settings, model: torch.nn.Module, caches: dict, curve: dict | None) -> dict[str, Any]:
    # A context near the verify curve's (384 + up to 145 new tokens vs 512), within the caches' room.
    prompt = prompt_ids(s, CONTEXT - 128, seed=1).to(s.device)
    n_max = 1 + s.passes * (max(ORACLE_KS) + 1)
    out: dict[str, Any] = {"passes": s.passes, "prompt_len": prompt.shape[1]}
    for kind in CACHE_KINDS:
        kv = caches[kind]
        reference, _ = plain_generate(model, prompt, n_max, cache=kv)
        ref = reference.tolist()
        rows: dict[str, Any] = {}
        for k in ORACLE_KS:
            n_new = 1 + s.passes * (k + 1)  # the prefill token, then `passes` full passes
            _, ref = oracle_run(model, prompt, k, n_new, kv, ref)
            sync(s.device)
            st = speculative_generate(model, prompt, OracleDrafter(ref), k, n_new, cache=kv)[1]
            per_pass = st.decode_time_s / st.target_passes
            t_verify = None if curve is None else curve[f"{kind}_ms"][str(k + 1)] / 1000
            rows[str(k)] = {
                "tau": st.tau,
                "tau_exact": st.tau == k + 1,
                "pass_ms": round(per_pass * 1000, 4),
                "verify_ms": None if t_verify is None else round(t_verify * 1000, 4),
                "overhead_ms": None if t_verify is None else round((per_pass - t_verify) * 1000, 4),
                "overhead_frac": None if t_verify is None else round(1 - t_verify / per_pass, 4),
                "tokens_per_s": round((st.new_tokens - 1) / st.decode_time_s, 2),
            }
        out[kind] = rows
        out[f"{kind}_syncs_per_pass"] = syncs_per_pass(s, model, prompt, ref, kv)
    return out


def syncs_per_pass(s: Settings, model: torch.nn.Module, prompt: torch.Tensor, ref: list[int], kv: Any) -> float | None:
    """Host synchronisations per verify pass at k = 4 (CUDA's sync debug mode counts them; None on CPU).

    The acceptance decision needs one; a second or more means something in the pass waits on the GPU.
    """
    if s.device.type != "cuda":
        return None
    k = 4
    n_new = 1 + s.passes * (k + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            st = speculative_generate(model, prompt, OracleDrafter(ref), k, n_new, cache=kv)[1]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return round(syncs / st.target_passes, 2)


def section_plain(s: Settings, model: torch.nn.Module, caches: dict) -> dict[str, Any]:
    prompt = prompt_ids(s, 32, seed=2).to(s.device)
    out: dict[str, Any] = {"new_tokens": s.plain_tokens}
    for kind in CACHE_KINDS:
        plain_generate(model, prompt, 8, cache=caches[kind])  # warm-up (graph capture)
        sync(s.device)
        _, st = plain_generate(model, prompt, s.plain_tokens, cache=caches[kind])
        out[f"{kind}_tokens_per_s"] = round((st.new_tokens - 1) / st.decode_time_s, 2)
    out["graphs_speedup"] = round(out["static_tokens_per_s"] / out["dynamic_tokens_per_s"], 3)
    # Whether the static cache really replayed CUDA graphs (False on CPU, or after a failed capture).
    out["static_graphs"], out["graph_error"] = caches["static"].graphs, caches["static"].graph_error
    return out


def _linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def train_flops(s: Settings, model: torch.nn.Module, head: torch.nn.Module, tokens: int) -> tuple[float, float]:
    """(all FLOPs of one training step, the head's share) for `tokens` tokens of length-T rows.

    Matmul FLOPs only (2 per multiply-add), backward = 2 x forward. Target feature forward: its linear layers
    without the lm_head, plus causal attention (QK^T and AV: 2 * 2 * T/2 * H per token and layer). Soft labels:
    the target lm_head once. Head, per TTT step: its decoder layer and draft lm_head, and ttt_attention, which
    computes the full T x T scores (4 * T * H per token); fc once.
    """
    h, layers, t = int(s.shapes["hidden_size"]), int(s.shapes["num_hidden_layers"]), s.seq_len
    vocab = int(s.shapes["vocab_size"])
    target_linear = _linear_params(model.get_decoder())
    target = 2 * tokens * target_linear + 2 * tokens * t * h * layers + 2 * tokens * h * vocab
    step_params = _linear_params(head.midlayer) + head.lm_head.weight.numel()
    fwd = 2 * tokens * head.fc.weight.numel() + head.ttt_length * (2 * tokens * step_params + 4 * tokens * t * h)
    return target + 3 * fwd, 3 * fwd


def section_head_train(s: Settings, model: torch.nn.Module, peak: float | None) -> dict[str, Any]:
    family = registry.get(s.head.family)
    io = target_io(model, "random-llama")
    with torch.device(s.device):  # built where it trains: fp32 master weights, bf16 autocast (mixed_precision)
        head = family.build(s.head, io)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4, betas=(0.9, 0.95))
    layers = family.feature_layers(s.head, io.config)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(int(s.shapes["vocab_size"]), (s.batch, s.seq_len), generator=g).to(s.device)
    ones = torch.ones_like(ids)
    autocast = torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=s.dtype != torch.float32)

    def step() -> None:
        feats, _ = forward_features(model, ids, ones, layers)  # online features of the frozen target
        batch = {"input_ids": ids, "loss_mask": ones, "attention_mask": ones, "last": feats.last, "aux": feats.aux,
                 "target_argmax": greedy_ids(model, feats.last).long()}
        with autocast:
            loss, _ = family.loss(head, batch, io)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up (allocations, kernels)
    sync(s.device)
    t0 = time.perf_counter()
    for _ in range(s.train_steps):
        step()
    sync(s.device)
    dt = (time.perf_counter() - t0) / s.train_steps
    tokens = s.batch * s.seq_len
    total, head_only = train_flops(s, model, head, tokens)
    return {
        "batch": s.batch, "seq_len": s.seq_len, "ttt_length": head.ttt_length,
        "draft_vocab": int(head.lm_head.weight.shape[0]), "layer_ids": layers,
        "step_s": round(dt, 4), "tokens_per_s": round(tokens / dt, 1),
        "tflops_per_s": round(total / dt / 1e12, 3),
        "mfu": None if peak is None else round(total / dt / 1e12 / peak, 4),
        "head_mfu": None if peak is None else round(head_only / dt / 1e12 / peak, 4),
        "peak_tflops": peak,
    }


def section_extract(s: Settings, model: torch.nn.Module) -> dict[str, Any]:
    layers = registry.get(s.head.family).feature_layers(s.head, model.config)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(int(s.shapes["vocab_size"]), (s.extract_rows, s.seq_len), generator=g).to(s.device)
    mask = torch.ones_like(ids)
    decoder = model.get_decoder()

    def extract() -> None:
        feats, _ = forward_features(model, ids, mask, layers)
        for t in (feats.last, feats.aux):
            t.cpu()

    @torch.no_grad()
    def plain() -> None:
        decoder(input_ids=ids, attention_mask=mask, use_cache=False)

    out: dict[str, Any] = {"rows": s.extract_rows, "seq_len": s.seq_len, "layer_ids": layers}
    for name, fn in (("extract", extract), ("plain", plain)):
        fn()
        times = []
        for _ in range(max(s.repeats // 2, 1)):
            sync(s.device)
            t0 = time.perf_counter()
            fn()
            sync(s.device)
            times.append(time.perf_counter() - t0)
        out[f"{name}_tokens_per_s"] = round(ids.numel() / statistics.median(times), 1)
    out["ratio"] = round(out["extract_tokens_per_s"] / out["plain_tokens_per_s"], 4)
    return out


def section_batch_heads(s: Settings, model: torch.nn.Module) -> dict[str, Any]:
    family = registry.get(s.head.family)
    io = target_io(model, "random-llama")
    torch.manual_seed(5)
    head = family.build(s.head, io)
    place_head(head, s.device, s.dtype, "target")
    make = family.drafter_factory(head, io, "chain", 3)
    prompt = prompt_ids(s, 128, seed=5)[0].tolist()
    out: dict[str, Any] = {"k": 3, "new_tokens": s.batch_tokens, "prompt_len": len(prompt)}
    for b in s.batch_sizes:
        rows = [prompt] * b
        runs = [BatchRun(model, rows, s.batch_tokens, 0), BatchRun(model, rows, s.batch_tokens, 0, k=3, make_drafter=make),
                BatchRun(model, rows, s.batch_tokens, 0, k=3, make_drafter=make, together=False)]
        plain, together, alone = interleave_batches(runs)
        ms = [1000 * r.decode_s / r.passes for r in (plain, together, alone)]
        out[str(b)] = {"plain_pass_ms": round(ms[0], 3), "together_pass_ms": round(ms[1], 3),
                       "alone_pass_ms": round(ms[2], 3), "tau": round(together.tau, 3),
                       "identical": bool(torch.equal(plain.tokens, together.tokens)
                                         and torch.equal(plain.tokens, alone.tokens))}
    return out


# ----------------------------------------------------------------------------------------------- report
def markdown(r: dict[str, Any]) -> str:
    """The headline numbers as a markdown table (n/a where a section failed)."""

    def get(*path: str) -> Any:
        node: Any = r
        for p in path:
            if not isinstance(node, dict) or node.get(p) is None:
                return "n/a"
            node = node[p]
        return node

    rows = [("device", get("env", "device")), ("torch / transformers", f"{get('env', 'torch')} / {get('env', 'transformers')}")]
    for n in ("1", "8", "64"):
        rows.append((f"T({n}) ms, eager / static", f"{get('verify_cost', 'dynamic_ms', n)} / {get('verify_cost', 'static_ms', n)}"))
    for k in ("1", "4", "8"):
        rows.append((f"oracle k={k}: pass ms (overhead ms), eager / static",
                     f"{get('oracle', 'dynamic', k, 'pass_ms')} ({get('oracle', 'dynamic', k, 'overhead_ms')}) / "
                     f"{get('oracle', 'static', k, 'pass_ms')} ({get('oracle', 'static', k, 'overhead_ms')})"))
    rows.append(("host syncs per verify pass (k=4), eager / static",
                 f"{get('oracle', 'dynamic_syncs_per_pass')} / {get('oracle', 'static_syncs_per_pass')}"))
    rows.append(("static cache replays CUDA graphs", f"{get('plain', 'static_graphs')} {get('plain', 'graph_error')}"))
    rows.append(("plain tokens/s, eager / static", f"{get('plain', 'dynamic_tokens_per_s')} / {get('plain', 'static_tokens_per_s')}"))
    rows.append(("EAGLE-3 training tokens/s (MFU, head MFU)",
                 f"{get('head_train', 'tokens_per_s')} ({get('head_train', 'mfu')}, {get('head_train', 'head_mfu')})"))
    rows.append(("extraction / plain forward tokens/s",
                 f"{get('extract', 'extract_tokens_per_s')} / {get('extract', 'plain_tokens_per_s')}"))
    for b in ("1", "4", "16"):
        rows.append((f"batch {b}, head k=3: pass ms plain / together / one after another",
                     f"{get('batch_heads', b, 'plain_pass_ms')} / {get('batch_heads', b, 'together_pass_ms')} / "
                     f"{get('batch_heads', b, 'alone_pass_ms')}"))
    rows.append(("total seconds", get("total_s")))
    lines = ["| measure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    errors = [f"- {name}: {sec['error']}" for name, sec in r["sections"].items() if sec["error"]]
    return "\n".join(lines + ([""] + ["Errors:"] + errors if errors else [])) + "\n"


SECTIONS = ("verify_cost", "oracle", "plain", "head_train", "extract", "batch_heads")


def run_check(s: Settings, peak: float | None, only: set[str] | None = None,
              save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every section in turn; `save(r)` after each, so a run killed midway still leaves its numbers."""
    r: dict[str, Any] = {
        "tiny": s.tiny,
        "env": {"device": torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else platform.processor() or "cpu",
                "torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version(), "dtype": str(s.dtype).replace("torch.", "")},
        "shapes": dict(s.shapes),
        "sections": {},
        "build": None,
        **{name: None for name in SECTIONS},
        "total_s": None,
    }

    def section(name: str, fn: Callable[[], Any]) -> Any:
        if only is not None and name != "build" and name not in only:
            return None
        t0 = time.perf_counter()
        value, err = None, None
        if t0 - T_START > s.deadline_s:
            err = f"skipped: {t0 - T_START:.0f} s had passed (deadline {s.deadline_s:.0f} s)"
        else:
            try:
                value = fn()
            except Exception as e:  # one failed section must not lose the others' numbers (one device call)
                err = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        dt = time.perf_counter() - t0
        if name in SECTIONS:
            r[name] = value
        over = dt > s.budget[name]
        r["sections"][name] = {"seconds": round(dt, 2), "budget_s": s.budget[name], "over_budget": over, "error": err}
        print(f"[gpu_check] {name}: {dt:.1f} s{' (OVER BUDGET)' if over else ''}{' ERROR ' + err if err else ''}",
              file=sys.stderr, flush=True)
        r["total_s"] = round(time.perf_counter() - T_START, 1)
        if save is not None:
            save(r)
        return value

    model = section("build", lambda: build_target(s))
    if model is not None:
        r["build"] = {"params": sum(p.numel() for p in model.parameters())}
        if save is not None:
            save(r)
    if model is not None:
        # The same room as the verify curve's cache, so static forwards attend over as many slots.
        caches = {kind: new_kv(model, kind, room=CONTEXT + max(VERIFY_NS)) for kind in CACHE_KINDS}
        section("verify_cost", lambda: section_verify_cost(s, model))
        section("oracle", lambda: section_oracle(s, model, caches, r["verify_cost"]))
        section("plain", lambda: section_plain(s, model, caches))
        del caches
        section("head_train", lambda: section_head_train(s, model, peak))
        section("extract", lambda: section_extract(s, model))
        section("batch_heads", lambda: section_batch_heads(s, model))
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (the same code; for tests)")
    ap.add_argument("--json", type=Path, default=ROOT / "runs" / "gpu_check.json", help="where the JSON goes")
    ap.add_argument("--md", type=Path, default=None, help="markdown table (default: the JSON path with .md)")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "llama8b.yaml", help="head and batch settings")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak for MFU")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help=f"skip sections not started this many seconds after launch (default {DEADLINE_S:.0f}; none with --tiny)")
    ap.add_argument("--only", default=None, help=f"comma-separated sections to run (of {', '.join(SECTIONS)})")
    args = ap.parse_args(argv)
    only = None if args.only is None else {x.strip() for x in args.only.split(",") if x.strip()}
    if only is not None and not only <= set(SECTIONS):
        print(f"error: --only: unknown section {sorted(only - set(SECTIONS))[0]!r} (known: {', '.join(SECTIONS)})",
              file=sys.stderr)
        return 2
    if args.tiny:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("error: no CUDA device is visible; run with --tiny for the CPU version", file=sys.stderr)
        return 2
    try:
        s = Settings(args.tiny, device, args.config)
    except ValueError as e:  # ConfigError: one line naming the file and key
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.deadline_s is not None:
        s.deadline_s = args.deadline_s
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for key, v in PEAK_TFLOPS.items() if key in name), None)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    md = args.md or args.json.with_suffix(".md")

    def save(r: dict[str, Any]) -> None:
        args.json.write_text(json.dumps(r, indent=1, default=str))
        md.write_text(markdown(r))

    r = run_check(s, peak, only, save)
    print(markdown(r))
    return 1 if any(sec["error"] for sec in r["sections"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
