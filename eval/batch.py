"""Batched exact speculative decoding with any drafter (trained heads included), and the batch-size sweep.

    from eval.batch import batched_generate
    res = batched_generate(model, prompts, 32, pad_id, k=4, make_drafter=make_head)   # res.tokens [B, 32]
    python -m eval.run --head runs/qs/head --drafter head+ngram --batch-sizes 1,4,16 --out E   # the sweep

Design. All B rows share one left-padded KV cache (data.kvcache.DynamicKV, one attention mask). Every row
has its own drafter (heads.base.Drafter: begun on the row's prompt and the row's captured features), its
own draft policy and its own GenerationStats. One pass:
  1. each row drafts through the decoder's own `draft_pass` (the policy's lengths, or k; capped so the row
     never passes max_new_tokens); a row may draft nothing;
  2. ONE target forward over [root_r, nodes_r ..] of every row, shorter drafts padded with filler nodes
     (the root's token, each a child of the root: never an ancestor of a real node). Chains go through the
     padded causal mask, trees through a per-row 4D mask (DynamicKV._padded); the pass captures the
     layers the drafters need (`capture_layers`) for every row;
  3. each row is judged by the decoder's own `judge` (verify_tree: greedy, or the exact sampling rule with
     the row's generator) on its own rows of the logits: it accepts its OWN length a_r;
  4. ragged keep (DynamicKV.keep_rows): row r keeps its root and accepted path packed; the slots of a row
     that accepted fewer than the longest are masked out of every later pass, so each row's cache holds
     exactly its committed tokens and its positions count real tokens only: nothing is truncated to the
     batch minimum. The drafter of row r commits its path with its own rows of the captured features;
  5. a row that has its max_new_tokens leaves the batch (DynamicKV.select).
Greedy rows are therefore token-identical to plain decoding, and sampled rows keep plain sampling's law
(the decoder's rule, row by row). Rows never stop at EOS (a throughput measurement, not a chat).

A drafter is one request's state (its own head KV cache), so each row drafts through its own drafter; at a
fixed k, rows whose head family drafts several requests at once (`draft_together` on the drafter's class:
EAGLE-1/3 chains, one head pass per depth; DFlash blocks, one block pass; Medusa trees, one pass of each head;
MTP chains, one pass of each step's module) get their drafts from those passes for the whole batch first, and
where the family holds its commits (`settle_together`: EAGLE, DFlash) the head commits of every row (a policy's
rows included) are held and run in one head pass at the end of the pass; under a policy, the rows its choice
lets the head draft are drafted together the same way (their deferred commits settled together first). On a GPU, where a batched pass of the target costs
about one row's, per-row head passes were what the fixed-k head lost under load (docs/results.md, "GPU").

Load-aware drafting (eval.policy.LoadAware): each row's AdaptivePolicy prices a pass with the row's share of
a batch pass, T(B, n) / B, from the cost surface T(B, n) measured before the sweep (eval.costs.
measure_cost_surface) and refined by the run's own timed batch passes, and its head's draft at the share of its
own draft that drafting the rows together costs (eval.costs.measure_draft_share, per batch size); then a batch gate drops the drafts of
rows whose drafting would widen the shared pass more than their expected tokens pay for, down to a plain
pass (nothing drafted: the drafters are not called, their commits wait in DeferredSync). The sweep keeps
one LoadAware per load-aware method for all its runs, so what the timed passes taught carries over.

    python -m pytest -q tests/test_batch.py
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch
from torch import nn

from data.kvcache import DynamicKV, left_pad
from eval.decoder import (
    EMPTY,
    DraftPolicy,
    GenerationStats,
    cycle_orders,
    draft_pass,
    judge,
    record_verdict,
    speculative_generate,
)
from eval.drafters import DeferredSync, HybridDrafter
from eval.policy import LoadAware
from heads.base import Drafter, DraftTree, Features

__all__ = ["BatchResult", "BatchRun", "Method", "Prefill", "SharedPrefill", "batched_generate", "interleave_batches",
           "prefill", "sweep"]


@dataclass
class BatchResult:
    """One batched generation: tokens [B, max_new_tokens], batch passes, decode seconds (prefill excluded),
    the rows' merged stats, each row's finish time (seconds after decoding started) and the decode seconds
    spent inside the target's forward (the rest is drafting and per-row bookkeeping: scripts/bench_batch.py)."""

    tokens: torch.Tensor
    passes: int
    decode_s: float
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_s: list[float] = field(default_factory=list)
    row_stats: list[GenerationStats] = field(default_factory=list)
    forward_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.numel() / self.decode_s if self.decode_s > 0 else float("inf")

    @property
    def tau(self) -> float:
        """Tokens per row per target pass it took part in, counting the corrected/bonus token (GenerationStats')."""
        return self.stats.tau

    @property
    def latency_s(self) -> float:
        """Mean per-request decode latency: when each row had all its tokens."""
        return sum(self.finish_s) / len(self.finish_s) if self.finish_s else 0.0


@dataclass
class _Row:
    """One request of the batch: its drafter, policy, emitted tokens, stats and sampling generator."""

    prompt: list[int]
    drafter: Drafter | None
    policy: DraftPolicy | None
    generator: torch.Generator | None
    max_new: int
    out: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=lambda: GenerationStats(generations=1))
    tree: DraftTree | None = None
    head: Any = None  # its head drafter when that holds its commits for a batched settle (_hold_commits)


def _row_features(feats: Features | None, r: int, cols: torch.Tensor | slice) -> Features | None:
    """Row r's features at columns `cols` of the last pass ([1, len(cols), ...], the decoder's layout)."""
    if feats is None:
        return None
    return Features(last=feats.last[r:r + 1, cols], aux=None if feats.aux is None else feats.aux[r:r + 1, cols])


def _block(rows: list[_Row], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pass's input [B, W+1] (root, nodes, fillers) and, when some row drafted a tree, parents [B, W]."""
    width = max(len(r.tree) for r in rows)
    ids = torch.empty(len(rows), width + 1, dtype=torch.long)
    parents = torch.full((len(rows), width), -1, dtype=torch.long)  # fillers hang off the root
    tree = False
    for i, r in enumerate(rows):
        n = len(r.tree)
        ids[i] = r.out[-1]  # the root; also the fillers' token (never judged)
        ids[i, 1:n + 1] = r.tree.tokens.cpu()
        parents[i, :n] = r.tree.parents.cpu()
        tree = tree or not bool(torch.equal(r.tree.parents.cpu(), torch.arange(-1, n - 1)))
    return ids.to(device), (parents if tree else None)


@dataclass
class Prefill:
    """The prompts' prefill: the cache holding them (left padded), every row's logits at its last prompt
    position [B, 1, V], the captured features of every prompt position (None without capture) and the mask."""

    kv: DynamicKV
    last: torch.Tensor
    feats: Features | None
    mask: torch.Tensor


def prefill(model: nn.Module, prompts: Sequence[Sequence[int]], pad_id: int,
            capture: Sequence[int] | None) -> Prefill:
    """One forward over the left-padded prompts, capturing the layers `capture` names."""
    ids, mask = left_pad(prompts, pad_id)
    kv = DynamicKV(model, capture)
    logits, feats = kv.run(ids, logits_to_keep=1, pad=mask)  # left padded: every row's last position is real
    kv.keep(range(ids.shape[1]))
    return Prefill(kv, logits, feats, mask)


class SharedPrefill:
    """One prefill of a batch's prompts per set of captured layers, shared by every run on those prompts (the
    sweep's rounds: plain and each method, every round): each run forks the cache (DynamicKV.fork). A run that
    captures nothing (plain, the n-gram) takes any one already made. The prefill is the same computation for every
    run, and the sweep times decoding only, so sharing it changes no token and no timed second; at batch 16
    on the quickstart's target it was about half of the sweep's time (21 prefills of 5 s)."""

    def __init__(self, model: nn.Module, prompts: Sequence[Sequence[int]], pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.prompts = [list(p) for p in prompts]
        self._made: dict[tuple[int, ...] | None, Prefill] = {}

    def get(self, prompts: Sequence[Sequence[int]], capture: Sequence[int] | None) -> Prefill:
        """The prefill of `prompts` (which must be this one's) capturing `capture`; made on first use."""
        if [list(p) for p in prompts] != self.prompts:
            raise ValueError("SharedPrefill: a run on other prompts than the shared prefill's")
        key = None if capture is None else tuple(capture)
        if key is None and self._made:
            return next(iter(self._made.values()))
        if key not in self._made:
            self._made[key] = prefill(self.model, self.prompts, self.pad_id, capture)
        return self._made[key]


def _begin(rows: list[_Row], pre: Prefill, sampling: dict[str, Any]) -> None:
    """Every row's first token from its last prompt position; drafters begun on their row's features."""
    for i, r in enumerate(rows):
        r.out.append(judge(EMPTY, pre.last[i], generator=r.generator, **sampling).next_token)
        if r.drafter is not None and len(r.out) < r.max_new:
            cols = pre.mask[i].nonzero().reshape(-1).to(pre.last.device)
            prompt = torch.tensor([r.prompt], dtype=torch.long, device=pre.last.device)  # [1, T], as the decoder passes it
            r.drafter.begin(prompt, _row_features(pre.feats, i, cols), r.out[0])


class BatchRun:
    """One batched generation, a pass at a time (see the module doc): set up and prefilled (untimed) on
    construction; `step()` runs one timed pass; `result()` once `done`. `batched_generate` runs one to the
    end; `interleave_batches` advances several pass by pass, so that each one's seconds are its own passes'
    and load drift on a shared machine falls on all of them alike. together=False makes every row draft and
    commit alone (no draft_together / settle_together): what they are worth (scripts/bench_batch.py --together,
    scripts/gpu_check.py). shared: start from that prefill of these prompts (forked) instead of computing one."""

    @torch.no_grad()
    def __init__(self, model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                 k: int = 0, make_drafter: Callable[[], Drafter] | None = None,
                 make_policy: Callable[[], DraftPolicy] | None = None, load: LoadAware | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 together: bool = True, shared: SharedPrefill | None = None):
        if (k > 0 or make_policy is not None) and make_drafter is None:
            raise ValueError("speculative batches need a drafter factory")
        if load is not None and make_policy is None:
            raise ValueError("a load-aware batch needs per-row policies (make_policy)")
        if max_new_tokens < 1 or k < 0:
            raise ValueError(f"need max_new_tokens >= 1 and k >= 0, got {max_new_tokens}, {k}")
        self.device = next(model.parameters()).device
        self.k, self.load, self.max_new = k, load, max_new_tokens
        self.together = together  # False: every row drafts and commits alone (the before of a benchmark)
        speculative = k > 0 or make_policy is not None
        self.rows = []
        for i, p in enumerate(prompts):
            gen = torch.Generator().manual_seed(seed + i) if temperature > 0 else None
            self.rows.append(_Row(list(p), make_drafter() if speculative else None,
                                  make_policy() if make_policy is not None else None, gen, max_new_tokens))
        for r in self.rows:
            if r.policy is not None:
                r.policy.reset(k)
        if together:
            _hold_commits(self.rows)
        capture = self.rows[0].drafter.capture_layers if speculative else None
        if shared is None:
            pre = prefill(model, prompts, pad_id, capture)
            self.kv = pre.kv
        else:
            pre = shared.get(prompts, capture)
            self.kv = pre.kv.fork(capture)
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        _begin(self.rows, pre, self.sampling)
        self.active = [r for r in self.rows if len(r.out) < max_new_tokens]
        self.finish = {id(r): 0.0 for r in self.rows}
        self.passes, self.forward_s, self.decode_s = 0, 0.0, 0.0

    @property
    def done(self) -> bool:
        return not self.active

    @torch.no_grad()
    def step(self) -> None:
        """One pass: draft, one target forward over every active row, judge, ragged keep, commits."""
        active, load, max_new = self.active, self.load, self.max_new
        tc = time.perf_counter()
        _draft_all(active, self.k, self.sampling["temperature"], load, self.together)
        block, parents = _block(active, self.device)
        tv = time.perf_counter()
        logits, feats = self.kv.run(block, parents)
        self.forward_s += time.perf_counter() - tv
        verdicts = [judge(r.tree, logits[i, :len(r.tree) + 1], generator=r.generator, **self.sampling)
                    for i, r in enumerate(active)]
        self.kv.keep_rows([v.path for v in verdicts])
        if load is not None:
            load.observe(len(active), block.shape[1], time.perf_counter() - tv)
        self.passes += 1
        keep, emitted, finished = [], 0, []
        for i, (r, v) in enumerate(zip(active, verdicts)):
            record_verdict(r.stats, r.policy, r.tree, v, None)
            emitted += min(len(v.tokens), max_new - len(r.out))
            r.out.extend(v.tokens[:max_new - len(r.out)])
            if len(r.out) < max_new:
                keep.append(i)
                if r.drafter is not None:
                    # A chain's columns are a view (this pass's features are never written again: DynamicKV
                    # allocates every forward), no index copy per row.
                    r.drafter.commit(v.accepted, _row_features(feats, i, v.columns(logits.device)), v.next_token)
            else:
                finished.append(r)
        # The held head commits of the rows that go on, one head pass per head for all of them
        _settle_together([active[i].head for i in keep if active[i].head is not None])
        if load is not None:  # the whole pass, drafting and commits included: what the gate cannot price
            load.observe_cycle(len(active), emitted, time.perf_counter() - tc)
        if len(keep) < len(active):
            self.kv.select(torch.tensor(keep, dtype=torch.long, device=self.device))
            self.active = [active[i] for i in keep]
        self.decode_s += time.perf_counter() - tc
        for r in finished:  # seconds of this run's own passes until the row had all its tokens
            self.finish[id(r)] = self.decode_s

    def result(self) -> BatchResult:
        """The finished run: tokens, passes, its own decode seconds, the rows' merged and own stats."""
        stats = GenerationStats()
        for r in self.rows:
            r.stats.new_tokens = len(r.out)
            stats = stats.merge(r.stats)
        tokens = torch.tensor([r.out for r in self.rows], dtype=torch.long)
        return BatchResult(tokens, self.passes, self.decode_s, stats, [self.finish[id(r)] for r in self.rows],
                           [r.stats for r in self.rows], self.forward_s)


def interleave_batches(runs: Sequence[BatchRun]) -> list[BatchResult]:
    """Advance `runs` one pass each per cycle, in a fresh order each cycle (eval.decoder.cycle_orders: no run
    always follows the same one), until all are done; their results in order. Each run's seconds are its own
    passes', taken alternately, so a slow spell of the machine (measured: one plain batch-8 configuration at
    110 and then 76 tok/s minutes apart) lands on every run's passes, not on whichever ran during it
    (tests/test_batch.py plants a drift and checks both ways, and a slowdown after one run's passes)."""
    orders = cycle_orders(len(runs))
    while not all(r.done for r in runs):
        for i in next(orders):
            if not runs[i].done:
                runs[i].step()
    return [r.result() for r in runs]


def batched_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    k: int = 0,
    make_drafter: Callable[[], Drafter] | None = None,
    make_policy: Callable[[], DraftPolicy] | None = None,
    load: LoadAware | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> BatchResult:
    """Decode every prompt row for exactly `max_new_tokens` tokens (see the module doc); plain when k == 0 and no
    policy. make_policy: a fresh per-row policy (eval.decoder.DraftPolicy); load: the batch's load-aware pricing
    and gate (needs make_policy). Sampled rows (temperature > 0) draw with generator seed + row index."""
    return interleave_batches([BatchRun(model, prompts, max_new_tokens, pad_id, k, make_drafter, make_policy, load,
                                temperature, top_k, top_p, seed)])[0]


def _head_drafter(drafter: Drafter, flush: bool = True) -> Any:
    """The drafter that drafts a row's head tree: a hybrid's head, a DeferredSync's inner drafter (flushed
    first, as its draft would, unless flush is False), else the row's own."""
    if isinstance(drafter, HybridDrafter):
        drafter = drafter.head
    if isinstance(drafter, DeferredSync):
        if flush:
            drafter.flush()
        drafter = drafter.inner
    return drafter


def _hold_commits(rows: list[_Row]) -> None:
    """Rows whose head drafter's family runs several requests' commits at once (a `settle_together` on the
    drafter's class: heads.eagle's EagleDrafter, heads.dflash's DFlashDrafter) get it as `head`, set to hold its
    commits for that."""
    for r in rows:
        head = None if r.drafter is None else _head_drafter(r.drafter, flush=False)
        if getattr(type(head), "settle_together", None) is not None:
            head.hold = True
            r.head = head


def _settle_together(heads: list[Any]) -> None:
    """The held commits of these head drafters, one call per drafter class (one head pass per head)."""
    groups: dict[Any, list[Any]] = {}
    for h in heads:
        groups.setdefault(type(h).settle_together, []).append(h)
    for settle, hs in groups.items():
        settle(hs)


def _head_depth(r: _Row, k: int, budget: int, chosen: dict[str, int] | None) -> int:
    """How deep row r's head drafts this pass (draft_pass's rule): min(k, budget) at a fixed k; under a policy
    the chosen length, a hybrid's head its own share of it."""
    if r.drafter is None:
        return 0
    if chosen is None:
        return min(k, budget)
    kk = max(chosen.values(), default=0)
    return min(kk, chosen.get("head", kk)) if isinstance(r.drafter, HybridDrafter) else kk


def _draft_together(active: list[_Row], depths: list[int], temperature: float) -> None:
    """Rows whose head drafters' family drafts several requests at once (a `draft_together` on the drafter's
    class: heads.eagle's, heads.dflash's, heads.medusa's, heads.mtp's) get their drafts from one head pass per
    depth, block, head or step for the batch (their deferred commits settled together first); each row's own
    draft below then returns it. Per-row head passes were the batched decoder's cost on a GPU, where a batched
    pass of the target costs about one row's (docs/results.md, "GPU")."""
    groups: dict[Any, list[tuple[Any, int]]] = {}
    for r, n in zip(active, depths):
        if n > 0:
            head = _head_drafter(r.drafter)  # a DeferredSync is flushed here, as its own draft would
            together = getattr(type(head), "draft_together", None)
            if together is not None:
                groups.setdefault(together, []).append((head, n))
    for together, rows in groups.items():
        together([d for d, _ in rows], [n for _, n in rows], temperature)


def _draft_all(active: list[_Row], k: int, temperature: float, load: LoadAware | None, together: bool) -> None:
    """Every active row's draft for this pass (empty without a drafter): the policies' choices (under `load`,
    the gated ones) first, then the heads' chains together (unless `together` is False), then each row's
    draft_pass."""
    budgets = [r.max_new - len(r.out) - 1 for r in active]  # the pass itself adds one token (the decoder's rule)
    if load is not None:
        chosen = list(load.choose([(r.drafter, r.policy) for r in active], budgets))
    else:
        chosen = [None if r.policy is None else r.policy.choose(r.drafter, b) for r, b in zip(active, budgets)]
    if together:
        _draft_together(active, [_head_depth(r, k, b, c) for r, b, c in zip(active, budgets, chosen)], temperature)
    for r, c, b in zip(active, chosen, budgets):
        r.tree = EMPTY if r.drafter is None else draft_pass(r.drafter, r.policy, k, b, temperature, r.stats, chosen=c)


@dataclass
class Method:
    """One speculative method of the sweep: its drafter factory, fixed k or per-row policy, load-aware or not."""

    name: str
    k: int
    make_drafter: Callable[[], Drafter]
    make_policy: Callable[[], DraftPolicy] | None = None
    load_aware: bool = False  # price with the cost surface and gate the batch (needs make_policy)
    # load-aware: per batch size, the share of a row's own draft its head's batched draft costs
    # (eval.costs.measure_draft_share; None: every row priced as if it drafted alone)
    draft_share: dict[int, float] | None = None


def _single_stream_tau(model: nn.Module, prompt: Sequence[int], m: Method, max_new_tokens: int) -> float:
    """The single-stream decoder's tau on the same row (the batch-1 check: the same drafter, k and policy)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=next(model.parameters()).device)
    _, st = speculative_generate(model, ids, m.make_drafter(), m.k, max_new_tokens,
                                 policy=m.make_policy() if m.make_policy is not None else None)
    return st.tau


def _sweep_row(model: nn.Module, batch: list[Sequence[int]], pad_id: int, methods: Sequence[Method],
               max_new_tokens: int, loads: dict[str, LoadAware], repeats: int,
               progress: Callable[[str], None] | None, load_aware_repeats: int = 0) -> dict[str, Any]:
    """One batch size of the sweep: `repeats` rounds, each running plain and every method pass-interleaved
    (`interleave_batches`: a fresh order every cycle; the list also rotated from round to round), then plain
    and the load-aware methods alone up to `load_aware_repeats` rounds in all; a load-aware method's gate is
    its one LoadAware of the sweep (`loads`). A method's speedup pairs each of its rounds with that round's
    plain run."""
    # name -> per round it ran: (its result, drafts its gate dropped, that round's plain result)
    runs: dict[str, list[tuple[BatchResult, int, BatchResult]]] = {"plain": [], **{m.name: [] for m in methods}}
    shared = SharedPrefill(model, batch, pad_id)  # every run of every round starts from the same prefill
    for rep in range(max(repeats, load_aware_repeats)):
        order: list[Method | None] = [None, *(m for m in methods if rep < repeats or m.load_aware)]  # None = plain
        turn = order[rep % len(order):] + order[:rep % len(order)]
        started = []
        for m in turn:
            if m is None:
                started.append(("plain", BatchRun(model, batch, max_new_tokens, pad_id, shared=shared), None, 0))
                continue
            load = loads.get(m.name)
            started.append((m.name, BatchRun(model, batch, max_new_tokens, pad_id, k=m.k, make_drafter=m.make_drafter,
                                             make_policy=m.make_policy, load=load, shared=shared), load,
                            load.gated if load is not None else 0))
        results = interleave_batches([run for _, run, _, _ in started])
        plain_res = next(res for (name, *_), res in zip(started, results) if name == "plain")
        for (name, _, load, gated), res in zip(started, results):
            runs[name].append((res, load.gated - gated if load is not None else 0, plain_res))
    plain_all = [r for r, _, _ in runs["plain"]]
    row: dict[str, Any] = {"batch_size": len(batch), "plain_tok_s": median(r.tokens_per_s for r in plain_all),
                           "plain_latency_s": median(r.latency_s for r in plain_all), "methods": {}}
    for m in methods:
        res = [r for r, _, _ in runs[m.name]]
        plain = [p for _, _, p in runs[m.name]]
        first = res[0]
        row["methods"][m.name] = {
            "tok_s": median(r.tokens_per_s for r in res),
            "speedup": median(r.tokens_per_s / p.tokens_per_s for r, p in zip(res, plain)),
            "speedups": [r.tokens_per_s / p.tokens_per_s for r, p in zip(res, plain)],
            "latency_s": median(r.latency_s for r in res), "tau": median(r.tau for r in res),
            "drafted_tokens": [r.stats.drafted_tokens for r in res],  # per round: whether a gate drafted at all
            "identical": all(bool(torch.equal(plain_all[0].tokens, r.tokens)) for r in res),
            "chosen_k": {s: {str(n): c for n, c in cs.items()} for s, cs in first.stats.chosen_k.items()},
            "gated_drafts": runs[m.name][0][1]}
        if progress is not None:
            r = row["methods"][m.name]
            progress(f"batch {len(batch)}: plain {row['plain_tok_s']:.1f} tok/s, {m.name} {r['tok_s']:.1f} tok/s "
                     f"({r['speedup']:.2f}x, tau {r['tau']:.2f}; {len(res)} rounds)")
    return row


def first_not_faster(curve: Sequence[tuple[int, float | None]]) -> int | None:
    """The crossover of a (batch size or concurrency, speedup over plain) curve in ascending order: the first
    size whose speedup is not above 1 (an unmeasured speedup, None, counts as not faster); None when every
    size pays."""
    return next((size for size, speedup in curve if speedup is None or speedup <= 1.0), None)


def sweep(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    pad_id: int,
    batch_sizes: Sequence[int],
    methods: Sequence[Method],
    max_new_tokens: int = 32,
    surface: dict[int, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    repeats: int = 1,
    load_aware_repeats: int = 0,
) -> dict[str, Any]:
    """Throughput and per-request latency at each batch size: plain and every method pass-interleaved
    (`interleave_batches`: one pass of each per cycle, in a fresh order), `repeats` rounds with the order rotated each round (a method's
    speedup is the median of its per-round ratios to that round's plain run, and within a round the machine's
    load drift falls on the passes of both sides of each ratio alike).

    load_aware_repeats: rounds in all for the load-aware methods, the extra ones run with plain alone. Their
    bound is 0.98x plain, and where they draft nothing their true ratio is 1: a 32-token round of plain
    against plain read 0.95-1.06 here (sd 1.5-3% a round), so two rounds cannot resolve 2%; their passes
    cost a plain pass each, where the fixed methods' cost two to three.

    Rows are the prompts cycled to fill the batch. Returns the report's `batch_sweep` section: {"methods",
    "max_new_tokens", "rows": [{batch_size, plain_tok_s, plain_latency_s, methods: {name: {tok_s, speedup,
    latency_s, tau, identical, chosen_k, drafted_tokens per round}}}], "crossover": {name: batch size}, "single_stream_tau": {name:
    tau}, "cost_surface_ms", "draft_share": {name: {batch size: share}} of the load-aware methods given one}. A
    method's crossover is the first batch size whose throughput is not above
    plain (None when it pays over the whole range); single_stream_tau is the decoder's tau on batch 1's row.
    surface (eval.costs.measure_cost_surface) is required by load-aware methods.
    """
    if not prompts:
        raise ValueError("batch sweep needs at least one prompt")
    if any(m.load_aware for m in methods) and not surface:
        raise ValueError("a load-aware method needs the measured cost surface")
    batched_generate(model, [prompts[0]], 2, pad_id)  # untimed: first-call allocation hits neither side
    # One gate per load-aware method for the whole sweep: what its timed passes taught (the load scale per
    # batch size, the realised rate of its drafting passes) carries from run to run, as a server's would from
    # request to request, instead of every 32-token run paying for its own first drafts again.
    loads = {m.name: LoadAware(surface, draft_share=m.draft_share) for m in methods if m.load_aware}
    rows = []
    for b in batch_sizes:
        if b < 1:
            raise ValueError(f"batch size must be >= 1, got {b}")
        rows.append(_sweep_row(model, [prompts[i % len(prompts)] for i in range(b)], pad_id, methods,
                               max_new_tokens, loads, repeats, progress, load_aware_repeats))
    crossover = {m.name: first_not_faster([(r["batch_size"], r["methods"][m.name]["speedup"]) for r in rows])
                 for m in methods}
    return {
        "methods": [m.name for m in methods],
        "k": {m.name: m.k for m in methods},
        "policy": {m.name: "load-aware" if m.load_aware else "adaptive" if m.make_policy else "fixed"
                   for m in methods},
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "load_aware_repeats": max(repeats, load_aware_repeats) if loads else None,
        "timing": "plain and every method pass-interleaved in each round, each timed over its own passes",
        "greedy": True,
        "tokens_per_s": "decode only (prefill excluded), all rows together",
        "latency": "mean per-request decode seconds (until a row has all its tokens)",
        "rows": rows,
        "crossover": crossover,
        "single_stream_tau": {m.name: _single_stream_tau(model, prompts[0], m, max_new_tokens) for m in methods},
        "cost_surface_ms": {str(b): v.ms() for b, v in (surface or {}).items()},
        "draft_share": {m.name: {str(b): f for b, f in m.draft_share.items()} for m in methods if m.draft_share},
    }
