"""Measured costs of speculative decoding, and the draft length (or tree size) they make worth it.

Verifying is not free on a CPU (SmolLM2-135M on 2 cores: ~57 ms for 1 new token, ~230 ms for 64), so the
decoder's k is chosen from measurements, never assumed:

    T = measure_verify_cost(model, context_len=256)          # VerifyCost: T(n) seconds for n new tokens
    acc, draft = calibrate(model, drafter, prompts, k=8)     # Calibration: acceptance per depth + DraftCost
    k, speedup = choose_k(acc, T, draft, k_max=16)           # k = 0 means plain decoding is fastest
    S = measure_cost_surface(model, (1, 4, 16), (1, 2, 5))   # {B: VerifyCost}: T(B, n), B rows of n tokens
    F = measure_draft_share(model, make_head, prompt, (1, 4, 16), k=4)   # {B: share of a row's draft, batched}
    place_head(head, device, torch.float32, "auto")          # eval.draft_dtype: the dtype the head drafts in
                                                             # (and from how many rows it runs float32)

The model (all times per target pass, one pass verifies the root plus the n draft nodes):
    E(k)     = 1 + f * sum_{j=1..k} prod_{i<=j} a_i     expected tokens per pass (the bonus/corrected token is
                                                         the 1); a_i = conditional acceptance at depth i,
                                                         f = fraction of passes that draft at all (n-gram < 1)
    time(k)  = D(k) + f * T(k+1) + (1 - f) * T(1)        D(k) = draft_fixed + f * k * draft_per_token
    speedup  = E(k) * T(1) / time(k)                     plain decoding costs T(1) per token
For a tree with n nodes the same holds with E = 1 + sum over nodes of P(node accepted), time = D(n) + T(n+1)
(`predicted_tree_speedup`). With f = 1 and a flat T this is docs/science.md's E / (k*c + 1) with
E = (1 - a^(k+1)) / (1 - a) for a constant a (eval.speedup.flat_speedup). Every one of these, and eval.policy's
per-pass choice, is E * T(1) / time through the one `speedup` function.
"""

from __future__ import annotations

import statistics
import sys
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from data.config import EvalConfig
from data.features import forward_features
from data.kvcache import DynamicKV, KVCache, new_kv, timed_pass
from eval.decoder import GenerationStats, speculative_generate
from heads.base import Drafter

DEFAULT_KS = (1, 2, 4, 8, 16, 32, 64)
# eval.draft_dtype auto: bfloat16 only when the head's matrices run at least this much faster in it (a smaller
# gain is inside what one timing varies by), and only for heads with at least AUTO_DTYPE_MIN_PARAMS in their
# matrices (a tiny head's draft costs little either way: untimed, it drafts in the target's dtype).
AUTO_DTYPE_MARGIN = 0.10
AUTO_DTYPE_MIN_PARAMS = 1_000_000
# Row counts at which auto times a bfloat16 head's matrices against float32 (WideRowsLinear): a drafted token is
# one row, a tree level a few, a commit the accepted path, a catch-up every skipped pass, and `begin` the prompt.
WIDE_ROWS_PROBE = (4, 8, 16, 32, 64)
DRAFT_DTYPES: tuple[str, ...] = typing.get_args(typing.get_type_hints(EvalConfig)["draft_dtype"])  # auto, target, bfloat16


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def linear_seconds(head: nn.Module, dtype: torch.dtype, rows: int = 1, repeats: int = 5,
                   rounds: int | None = None) -> float:
    """Median seconds of `rows` rows through every nn.Linear of `head` with its weights in `dtype` (copies: the
    head is left as it is). One row is what a drafted token costs in memory traffic, the bound of CPU drafting;
    many rows are the head's catch-ups and its `begin` over the prompt, bound by arithmetic instead. `rounds`
    per repeat: 20 // rows, at least 2 (a wide timing is long enough alone)."""
    rounds = rounds or max(2, 20 // rows)
    mats = [(m.weight.detach().to(dtype), None if m.bias is None else m.bias.detach().to(dtype))
            for m in head.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.randn(rows, w.shape[1], dtype=dtype, device=w.device) for w, _ in mats]

    def once() -> None:
        for (w, b), x in zip(mats, inputs):
            F.linear(x, w, b)

    with torch.no_grad():
        once()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(rounds):
                once()
            times.append((time.perf_counter() - t0) / rounds)
    return statistics.median(times)


class WideRowsLinear(nn.Linear):
    """An nn.Linear of a head drafting in a reduced dtype whose inputs of at least `wide_rows` rows go through a
    float32 copy of its weights (the result cast back), and narrower ones through its own weights.

    Why: on a CPU without native bfloat16 (AVX2) a bfloat16 matrix reads half the memory, which is what one
    drafted row is bound by, but multiplies slower, which is what many rows are bound by: on an AVX2 AMD EPYC
    the quickstart head's matrices took 0.9-1.1 against 1.9-3.6 ms for one row and 42-77 against 9-14 ms for
    64, and its `begin` over a 229-token prompt, run before its first draft of every request, 162 ms in
    bfloat16 against 36 ms with this (eval.costs.place_head times where the two cross on the machine at hand).
    Exactness does not depend on it: the drafter reports the q it drew, whatever dtype computed it."""

    wide_rows: int
    wide_weight: torch.Tensor
    wide_bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= self.wide_rows * x.shape[-1]:
            return F.linear(x.to(self.wide_weight.dtype), self.wide_weight, self.wide_bias).to(x.dtype)
        return super().forward(x)


def widen(head: nn.Module, rows: int) -> None:
    """Make every nn.Linear of `head` a WideRowsLinear running inputs of `rows` rows or more in float32, from
    float32 copies of its weights as they are now (call it before casting the head to its drafting dtype).
    The copies are plain attributes, which a later `head.to(dtype)` leaves in float32."""
    for m in head.modules():
        if type(m) is nn.Linear:
            m.wide_weight = m.weight.detach().to(torch.float32, copy=True)
            m.wide_bias = None if m.bias is None else m.bias.detach().to(torch.float32, copy=True)
            m.wide_rows = rows
            m.__class__ = WideRowsLinear


def wide_rows(head: nn.Module) -> int | None:
    """From how many rows `head`'s matrices run in float32 (`widen`); None where they never do."""
    return next((m.wide_rows for m in head.modules() if isinstance(m, WideRowsLinear)), None)


def place_head(head: nn.Module, device: torch.device, target_dtype: torch.dtype, choice: str = "auto",
               log: Callable[[str], None] = _stderr,
               timer: Callable[[nn.Module, torch.dtype, int], float] = linear_seconds) -> torch.dtype:
    """Move `head` to the target's device in the dtype it drafts in (eval.draft_dtype), and return that dtype.

    choice "target": the target's dtype; "bfloat16": bfloat16; "auto": on a CPU float32 target, bfloat16 when
    `timer` finds one row through the head's matrices at least AUTO_DTYPE_MARGIN faster in it, and then float32
    from the fewest rows (of WIDE_ROWS_PROBE, timed from the widest down) at which float32 stays that much faster
    (`widen`: a head's `begin` over the prompt and its catch-ups are many rows); the choice and the times are
    logged; else the target's dtype. Elsewhere (GPUs, a bfloat16 target, a head with fewer than
    AUTO_DTYPE_MIN_PARAMS in its matrices) the target's dtype, untimed. Exactness does not depend on it: the
    drafter reports the q it drew from, in whatever dtype it computed it."""
    if choice not in DRAFT_DTYPES:
        raise ValueError(f"eval.draft_dtype must be {', '.join(DRAFT_DTYPES[:-1])} or {DRAFT_DTYPES[-1]}, got {choice!r}")
    dtype = torch.bfloat16 if choice == "bfloat16" else target_dtype
    # one cast, from the weights as loaded (the timer copies them): never through the target's dtype first
    head.to(device=device)
    mats = sum(m.weight.numel() for m in head.modules() if isinstance(m, nn.Linear))
    if choice == "auto" and device.type == "cpu" and target_dtype == torch.float32 and mats >= AUTO_DTYPE_MIN_PARAMS:
        full, half = timer(head, torch.float32, 1), timer(head, torch.bfloat16, 1)
        dtype = torch.bfloat16 if half < (1 - AUTO_DTYPE_MARGIN) * full else target_dtype
        line = (f"eval.draft_dtype auto: {dtype_name(dtype)} (one row through the head's matrices: float32 "
                f"{full * 1e3:.2f} ms, bfloat16 {half * 1e3:.2f} ms)")
        if dtype == torch.bfloat16:
            wide, timed = None, []
            for rows in sorted(WIDE_ROWS_PROBE, reverse=True):
                full, half = timer(head, torch.float32, rows), timer(head, torch.bfloat16, rows)
                timed.append(f"{rows} rows: float32 {full * 1e3:.2f} ms, bfloat16 {half * 1e3:.2f} ms")
                if full >= (1 - AUTO_DTYPE_MARGIN) * half:
                    break
                wide = rows
            if wide is not None:
                widen(head, wide)
            line += (f", float32 from {wide} rows" if wide else ", never float32") + f" ({'; '.join(timed)})"
        log(line)
    head.to(dtype=dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 (the config's spelling)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class VerifyCost:
    """T(n): median seconds of one target forward over n new tokens on a cache of `context_len` tokens."""

    seconds: dict[int, float]
    context_len: int

    def __call__(self, n: int) -> float:
        """T(n), linear between measured n (and along the last segment's slope beyond them)."""
        if n < 1:
            raise ValueError(f"VerifyCost: n must be >= 1, got {n}")
        t = self.seconds.get(n)
        if t is not None:  # a measured size, before any sorting: the policy asks for these on every pass
            return t
        ks = sorted(self.seconds)
        if len(ks) == 1:
            return self.seconds[ks[0]]
        lo, hi = (ks[0], ks[1]) if n < ks[0] else (ks[-2], ks[-1])
        for a, b in zip(ks, ks[1:]):
            if a < n < b:
                lo, hi = a, b
        slope = (self.seconds[hi] - self.seconds[lo]) / (hi - lo)
        return max(self.seconds[lo] + slope * (n - lo), 0.0)

    def ms(self) -> dict[int, float]:
        return {k: round(v * 1000, 2) for k, v in sorted(self.seconds.items())}


@dataclass
class DraftCost:
    """Drafting time per pass: fixed + per_token * (nodes drafted); includes begin/commit bookkeeping."""

    fixed_s: float
    per_token_s: float

    def __call__(self, k: int) -> float:
        return self.fixed_s + self.per_token_s * k

    @staticmethod
    def fit(points: Sequence[tuple[float, float]]) -> DraftCost:
        """Least squares through (mean nodes per pass, draft seconds per pass) points, clamped to >= 0."""
        if not points:
            raise ValueError("DraftCost.fit: no points")
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0) if var > 0 else 0.0
        return DraftCost(fixed_s=max(my - slope * mx, 0.0), per_token_s=slope)


@torch.no_grad()
def measure_verify_cost(
    model: nn.Module,
    context_len: int = 256,
    ks: Sequence[int] = DEFAULT_KS,
    repeats: int = 5,
    seed: int = 0,
    cache: str = "dynamic",
) -> VerifyCost:
    """Time the target forward of k new tokens (all logits, as the decoder verifies) on a fixed cache.

    The cache ("dynamic" or "static", data.kvcache) holds `context_len` random tokens; each timed forward is
    dropped again, so every repeat sees the same context. One untimed warm-up forward per k (on CUDA it
    captures the static cache's graph); CUDA work is synchronised around each timed forward. The repeats
    are interleaved (round r times every k once, in order), so a slow spell of the machine lands on one
    repeat of several sizes, which the per-size median drops, instead of on every repeat of one size: the
    2-core VM timed T(1) at 63 ms and T(2) at 44 ms with the repeats back to back, a dip that told the
    policy a drafted token is cheaper than none.
    """
    dev = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    kv = new_kv(model, cache, room=context_len + max(ks))
    ctx = torch.randint(vocab, (1, context_len), generator=g)
    kv.run(ctx, logits_to_keep=1)
    kv.keep(range(context_len))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    inputs = {int(k): torch.randint(vocab, (1, k), generator=g) for k in ks}
    return VerifyCost(seconds=_round_robin(kv, inputs, repeats, sync), context_len=context_len)


def _round_robin(kv: KVCache, blocks: dict[int, torch.Tensor], repeats: int, sync: Callable[[], None]) -> dict[int, float]:
    """Median seconds per block of `repeats` timed passes, taken round-robin after one untimed warm-up round
    (every block once per round, so a slow spell of the machine hits every size alike)."""
    times: dict[int, list[float]] = {n: [] for n in blocks}
    for r in range(repeats + 1):
        for n, ids in blocks.items():
            dt = timed_pass(kv, ids, sync)
            if r:  # round 0 warms up
                times[n].append(dt)
    return {n: statistics.median(ts) for n, ts in times.items()}


@torch.no_grad()
def context_cache(model: nn.Module, ctx: torch.Tensor) -> DynamicKV:
    """A batched DynamicKV holding the B rows of `ctx` [B, T] (no padding) as committed context, the batched
    decoder's cache to time passes on (measure_cost_surface, scripts/bench_batch.py)."""
    kv = DynamicKV(model)
    kv.run(ctx, logits_to_keep=1, pad=torch.ones_like(ctx))
    kv.keep(range(ctx.shape[1]))
    return kv


@torch.no_grad()
def measure_cost_surface(
    model: nn.Module,
    batch_sizes: Sequence[int],
    ns: Sequence[int] = (1, 2, 3, 4, 6, 9, 17),
    context_len: int = 128,
    repeats: int = 5,
    seed: int = 0,
) -> dict[int, VerifyCost]:
    """T(B, n): median seconds of one target forward over B rows of n new tokens each, per batch size B.

    The batched decoder's own pass (eval.batch): a left-padded DynamicKV of B rows holding `context_len`
    random tokens each, the padded mask, all logits kept; every timed forward is dropped again. One untimed
    warm-up round, then `repeats` rounds over every n in turn (round-robin, so load drift on a shared machine
    hits every n alike: the curve's shape, which is what the policy prices, survives a busy machine better
    than its level). Returns {B: VerifyCost} (eval.policy.LoadAware's surface).
    """
    dev = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    surface: dict[int, VerifyCost] = {}
    for b in batch_sizes:
        kv = context_cache(model, torch.randint(vocab, (b, context_len), generator=g))
        blocks = {int(n): torch.randint(vocab, (b, n), generator=g) for n in ns}
        surface[int(b)] = VerifyCost(_round_robin(kv, blocks, repeats, sync), context_len=context_len)
    return surface


@torch.no_grad()
def measure_draft_share(
    model: nn.Module,
    make_drafter: Callable[[], Drafter],
    prompt: Sequence[int],
    batch_sizes: Sequence[int],
    k: int,
    repeats: int = 5,
) -> dict[int, float]:
    """Per batch size B: the seconds of B requests' k-token drafts made together (the drafter class's
    `draft_together`, as the batched decoder drafts its rows: eval.batch) over the seconds of the same B drafts
    made one after another; each row of a batch of B pays this share of its own draft (eval.policy.LoadAware).
    1.0 for B = 1, and for every B when the drafter's class drafts no requests together (or k < 1).

    Every request is the same: begun on `prompt` but its last two tokens, one draft (untimed: a head that
    builds its state lazily, MTP's step caches, does it there) and a commit of one position, so the timed
    drafts run in the state of a decoding request. Per repeat both ways are timed on fresh requests, in
    alternating order; the median ratio of the pairs, at most 1 (drafting together never has to be slower:
    the batched decoder could always draft row by row)."""
    probe = make_drafter()
    together = getattr(type(probe), "draft_together", None)
    sizes = sorted({int(b) for b in batch_sizes})
    if together is None or k < 1 or len(prompt) < 3:
        return dict.fromkeys(sizes, 1.0)
    dev = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=dev)
    feats, _ = forward_features(model, ids, None, probe.capture_layers or ())
    n = ids.shape[1]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def requests(b: int) -> list[Drafter]:
        out = []
        for _ in range(b):
            d = make_drafter()
            d.begin(ids[:, :n - 2], feats.slice(0, n - 2), int(ids[0, n - 2]))
            d.draft(k, 0.0)
            d.commit_tokens([], feats.slice(n - 2, n - 1), int(ids[0, n - 1]))
            out.append(d)
        return out

    def timed(ds: list[Drafter], batched: bool) -> float:
        sync()
        t0 = time.perf_counter()
        if batched:
            together(ds, [k] * len(ds), 0.0)
        for d in ds:
            d.draft(k, 0.0)
        sync()
        return time.perf_counter() - t0

    shares = {}
    for b in sizes:
        if b <= 1:
            shares[b] = 1.0
            continue
        ratios = []
        for r in range(repeats + 1):  # the first pair warms up
            alone, both = requests(b), requests(b)
            if r % 2:
                t_both, t_alone = timed(both, True), timed(alone, False)
            else:
                t_alone, t_both = timed(alone, False), timed(both, True)
            if r:
                ratios.append(t_both / t_alone)
        shares[b] = min(1.0, statistics.median(ratios))
    return shares


# A calibration judges a depth only on the passes that accepted every shallower one: its few dozen passes judge
# depth 1 thirty times and depth 4 a handful (the quickstart head once read 4 accepted of 4 there: a rate of
# 1.0). Each depth's rate is pulled toward the one above it by this many judgments (`shrunk_rates`).
PRIOR_PSEUDO_JUDGED = 4.0


def shrunk_rates(accepted: Sequence[float], judged: Sequence[float],
                 pseudo: float = PRIOR_PSEUDO_JUDGED) -> list[float]:
    """Conditional acceptance per depth, each depth's pulled toward the depth above it by `pseudo` judgments, up
    to the first untested depth: (accepted(d) + pseudo * rate(d-1)) / (judged(d) + pseudo); depth 1 as measured.

    Why: a draft length is chosen by a maximum over depths and the deepest measured rate stands for every deeper
    depth (eval.speedup.extend_rates), so a rate that came out high by chance on a few judgments buys deep
    drafts, and a request that rarely accepts depth 1 seldom judges the deep ones to correct it. A rate
    measured often keeps its value.
    Example: accepted [14, 7, 4, 4, 2], judged [31, 13, 6, 4, 4] -> [0.452, 0.518, 0.607, 0.804, 0.652];
    accepted [3, 1, 0], judged [4, 2, 0] -> [0.75, 0.667].
    """
    out: list[float] = []
    for a, j in zip(accepted, judged):
        if not j:
            break
        out.append(a / j if not out else (a + pseudo * out[-1]) / (j + pseudo))
    return out


@dataclass
class Calibration:
    """What a calibration run measured for one drafter."""

    acceptance: list[float]  # conditional acceptance per depth (shrunk_rates; 0 past the deepest one judged)
    draft_rate: float  # fraction of passes with a draft
    draft_cost: DraftCost
    stats: GenerationStats


def calibrate(
    model: nn.Module,
    drafter: Drafter,
    prompts: Sequence[torch.Tensor],
    k: int = 8,
    max_new_tokens: int = 48,
    eos_token_id: int | Sequence[int] | None = None,
) -> Calibration:
    """Greedy runs at draft length k (acceptance per depth up to k) and at k = 1 (to fit the draft cost line).

    Use prompts other than the ones being benchmarked, so k is not tuned on the test data.
    """
    if k < 1:
        raise ValueError(f"calibrate: k must be >= 1, got {k}")
    runs = {}
    for kk in sorted({1, k}, reverse=True):
        run = GenerationStats()
        for ids in prompts:
            _, st = speculative_generate(model, ids, drafter, kk, max_new_tokens, eos_token_id=eos_token_id)
            run = run.merge(st)
        runs[kk] = run
    points = [(r.drafted_tokens / r.target_passes, r.draft_time_s / r.target_passes)
              for r in runs.values() if r.target_passes]
    main = runs[k]
    rates = shrunk_rates(main.accepted_per_position, main.judged_per_position)
    rates += [0.0] * (len(main.judged_per_position) - len(rates))
    return Calibration(rates, main.draft_rate, DraftCost.fit(points), main)


def expected_tokens(acceptance: Sequence[float], k: int, draft_rate: float = 1.0) -> float:
    """E(k) = 1 + f * sum_{j=1..k} prod_{i<=j} a_i; depths past the measured ones count as rejected."""
    total, run = 0.0, 1.0
    for a in list(acceptance)[:k]:
        run *= a
        total += run
    return 1.0 + draft_rate * total


def speedup(tokens: float, seconds: float, plain_s: float) -> float:
    """The one speedup formula: E tokens per pass of `seconds` against plain decoding's one per T(1) = plain_s.

    Every prediction (choose_k, the report's speedup model, the tree's, the ideal one, eval.policy's per
    pass) ends here; they differ only in how they get E and the pass's seconds.
    """
    return tokens * plain_s / seconds


def pass_seconds(verify: VerifyCost, draft: DraftCost, nodes: float, draft_rate: float = 1.0) -> float:
    """Expected seconds of one pass drafting `nodes` nodes in a share f = draft_rate of passes:
    D(f * nodes) + f * T(nodes + 1) + (1 - f) * T(1) (the draft cost's fixed part is paid every pass)."""
    return draft(draft_rate * nodes) + (draft_rate * verify(nodes + 1) + (1.0 - draft_rate) * verify(1))


def predicted_speedup(
    acceptance: Sequence[float], k: int, verify: VerifyCost, draft: DraftCost, draft_rate: float = 1.0
) -> float:
    """E(k) * T(1) / (D(f*k) + f*T(k+1) + (1-f)*T(1)), see the module docstring; k = 0 gives 1."""
    if k == 0:
        return 1.0
    return speedup(expected_tokens(acceptance, k, draft_rate), pass_seconds(verify, draft, k, draft_rate), verify(1))


def choose_k(
    acceptance: Sequence[float], verify: VerifyCost, draft: DraftCost, k_max: int, draft_rate: float = 1.0
) -> tuple[int, float]:
    """The draft length in 0..k_max with the highest predicted speedup (0 = plain decoding), and that speedup."""
    best = (0, 1.0)
    for k in range(1, k_max + 1):
        s = predicted_speedup(acceptance, k, verify, draft, draft_rate)
        if s > best[1]:
            best = (k, s)
    return best


def predicted_tree_speedup(node_accept_probs: Sequence[float], verify: VerifyCost, draft: DraftCost) -> float:
    """Speedup of a tree of n nodes: E = 1 + sum of P(node accepted), time = D(n) + T(n + 1).

    D is priced per drafted node, as calibrate fits it (the nodes, not the depth, of each pass)."""
    n = len(node_accept_probs)
    if n == 0:
        return 1.0
    return speedup(1.0 + sum(node_accept_probs), pass_seconds(verify, draft, n), verify(1))


def ideal_speedup(stats: GenerationStats, verify: VerifyCost, draft: DraftCost) -> float:
    """The speedup a run would have with zero loop overhead: its measured tau, passes priced by T and D.

    ideal = tau * T(1) / mean over passes of (D(n_pass) + T(n_pass + 1)); the decoder's measured decode
    speedup divided by this is its overhead ratio (1 = no time lost outside drafting and the forwards).
    """
    if not stats.nodes_per_pass:
        return 1.0
    return speedup(stats.tau, statistics.fmean(pass_seconds(verify, draft, n) for n in stats.nodes_per_pass), verify(1))
