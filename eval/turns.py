"""The eval's turn loop: every question turn by turn at every temperature, all methods side by side per turn.

    runs = Turns(target, subject, costs, cfg.eval, seed, served).run(questions)   # [(temperature, Tally)]

A later turn sees the target's own plain answer to the earlier ones. On each turn plain and the decoder's
methods run pass-interleaved (eval.decoder.interleave: one pass of each per cycle, in a fresh order every
cycle, each timed over its own passes; the list also rotates from turn to turn), so that machine noise hits plain and speculative decoding
alike; transformers' prompt lookup runs whole after them. Every turn's sampling seed
is data.sampling.turn_seed(seed, benchmark, question id, turn), regeneration's derivation. Called by
eval.run.evaluate (python -m eval.run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from data.config import EvalConfig
from data.kvcache import KVCache, new_kv
from data.regenerate import render_rows
from data.sampling import turn_seed
from eval.bench import Question
from eval.decoder import GenerationStats, Steps, interleave, plain_steps, speculative_steps
from eval.drafters import DeferredSync, HybridDrafter, NgramDrafter
from eval.policy import AdaptivePolicy, LearnedVerifyCost, measured_prior
from eval.tally import BASELINES, Tally
from heads.base import Drafter

if TYPE_CHECKING:
    from eval.calibrate import Costs

Served = dict[tuple[str, str], list[tuple[list[int], int]]]  # (temperature, bench) -> [(prompt ids, seed)]
# A single-stream draft is taken only when predicted at least 5% faster than a plain pass, the batch gate's
# margin (eval.policy.LoadAware): a predicted gain below what one pass's timing varies by on a loaded CPU
# buys risk, not speed. Measured: the quickstart head alone on a passage-retrieval file drafted 73% of
# passes at a predicted 1.00-1.10x (acceptance 0.22) and ran at 0.87x.
SINGLE_STREAM_MARGIN = 1.05


def prompt_ids(tok: Any, messages: list[dict[str, str]], device: torch.device) -> torch.Tensor:
    """One conversation chat-templated with the generation prompt, as ids [1, T] (data.regenerate's rendering)."""
    return torch.tensor(render_rows(tok, [messages]), dtype=torch.long, device=device)


def hf_prompt_lookup(model: nn.Module, ids: torch.Tensor, k: int, max_new: int, eos: list[int],
                     pad: int) -> tuple[torch.Tensor, GenerationStats]:
    """transformers' prompt-lookup assisted generation, timed end to end (greedy): (new ids, stats).

    Only tokens and time are visible from outside generate(), so tau and acceptance stay unreported for it
    (stats without passes; the report shows '-')."""
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         prompt_lookup_num_tokens=k, eos_token_id=eos, pad_token_id=pad)
    stats = GenerationStats(generations=1)
    new = out[0, ids.shape[1]:].cpu()
    stats.new_tokens = int(new.numel())
    stats.total_time_s = time.perf_counter() - t0
    return new, stats


@dataclass
class Target:
    """The loaded target: model, tokenizer, TargetIO, device and the token ids that end an answer."""

    model: nn.Module
    tok: Any
    io: Any
    device: torch.device
    eos: list[int]


@dataclass
class Subject:
    """What is evaluated: the drafter kind, the head's config (None for the n-gram alone), the methods that run."""

    drafter: str  # one of DRAFTERS
    head_cfg: Any
    main: str  # the evaluated method's name: the head's family, "<family>+ngram" or "ngram"
    methods: list[str]  # main first, then the head alone beside a hybrid, then the baselines
    factory: Callable[[int], Callable[[], Drafter]]  # draft length -> a factory of fresh drafters
    draft_dtype: str | None = None  # the dtype the head drafts in (eval.draft_dtype resolved); None without a head
    # (topk, tokens) -> the factory of EAGLE-2 dynamic trees of that size: set where eval.tree "auto" may turn
    # into a tree sized from the measured verify curve (eval.calibrate.measure_costs), else None
    sized: Callable[[int, int], Callable[[int], Callable[[], Drafter]]] | None = None
    # the target ids the head can draft (its draft vocabulary's `t2d` mask), where it drafts from a reduced one
    vocab: torch.Tensor | None = None

    @property
    def hybrid(self) -> bool:
        return self.drafter == "head+ngram"


@dataclass
class Turns:
    """The per-turn loop: every question turn by turn at every temperature, all methods side by side per turn
    (`turn`: pass-interleaved, a fresh order every cycle; see the module docstring).

    A later turn sees the target's own plain answer to the earlier ones. With `served` (a dict,
    --engine vllm) every turn's prompt ids and seed are collected per (temperature, benchmark) for vLLM.
    """

    target: Target
    subject: Subject
    costs: Costs
    cfg: EvalConfig
    seed: int
    served: Served | None
    turn_index: int = 0  # turns run so far, over every temperature: who goes first rotates with it
    make_head: Callable[[], Drafter] = field(init=False)
    learned: LearnedVerifyCost = field(init=False)  # T(n) refined by every policy's timed passes, all run long
    caches: dict[str, KVCache] = field(init=False)  # eval.cache static: each method's own, reused turn to turn
    # Per method, per proposer: (accepted, judged) per depth over this benchmark's earlier turns at this
    # temperature, added to the calibration's counts as the next turn's prior (`policy_for`).
    pooled: dict[str, dict[str, tuple[list[int], list[int]]]] = field(init=False)
    live: dict[str, AdaptivePolicy] = field(init=False)  # the policies of the turn running now, by method

    def __post_init__(self) -> None:
        self.make_head = self.subject.factory(self.costs.k)
        self.learned = LearnedVerifyCost(self.costs.verify)
        self.caches, self.pooled, self.live = {}, {}, {}

    def run(self, questions: dict[str, list[Question]]) -> list[tuple[str, Tally]]:
        """(temperature key, tally) per eval.temperature, in order."""
        runs = []
        n_turns = sum(len(q.turns) for qs in questions.values() for q in qs) * len(self.cfg.temperature)
        bar = tqdm(total=n_turns, desc="eval turns", unit="turn", disable=None)
        for temp in self.cfg.temperature:
            tally = Tally()
            methods = [m for m in self.subject.methods if not (m == "hf_prompt_lookup" and temp > 0)]
            for bench, qs in questions.items():
                self.pooled = {}  # a benchmark's requests teach the next ones, not another benchmark's
                for q in qs:
                    self.question(q, bench, temp, methods, tally, bar)
            runs.append((f"{temp:g}", tally))
        bar.close()
        return runs

    def question(self, q: Question, bench: str, temp: float, methods: list[str], tally: Tally,
                 bar: tqdm) -> None:
        """All turns of one question; each turn's results go into the tally."""
        tok, main = self.target.tok, self.subject.main
        messages: list[dict[str, str]] = []
        for t, turn in enumerate(q.turns):
            messages.append({"role": "user", "content": turn})
            ids = prompt_ids(tok, messages, self.target.device)
            seed = turn_seed(self.seed, bench, q.id, t)
            if self.served is not None:
                self.served.setdefault((f"{temp:g}", bench), []).append((ids[0].tolist(), seed))
            order = ["plain"] + methods
            r = self.turn_index % len(order)  # rotate who goes first: noise and warm caches hit all alike
            results = self.turn(order[r:] + order[:r], ids, temp, seed)
            plain_ids = results["plain"][0]
            if self.subject.vocab is not None:
                tally.add_vocab(bench, q.category, plain_ids, self.subject.vocab)
            for name, (new, st) in results.items():
                same = bool(torch.equal(new.cpu(), plain_ids.cpu())) if temp == 0 else None
                tally.add(name, bench, q.category, st, same)
            # The next turn sees the target's own plain answer (skip the end-of-turn token).
            messages.append({"role": "assistant", "content": tok.decode(plain_ids.tolist(), skip_special_tokens=True)})
            self.turn_index += 1
            ms = results[main][1]
            bar.set_postfix_str(f"{bench} T={temp:g} tau {ms.tau:.2f} {ms.tokens_per_s:.1f} tok/s "
                                f"(plain {results['plain'][1].tokens_per_s:.1f})")
            bar.update(1)

    def turn(self, names: list[str], ids: torch.Tensor, temp: float,
             seed: int) -> dict[str, tuple[torch.Tensor, GenerationStats]]:
        """Every method on one turn, {name: (new ids, stats)}: the decoder's methods pass-interleaved
        (eval.decoder.interleave, in the order given), then transformers' prompt lookup, which runs whole."""
        ours = [n for n in names if n != "hf_prompt_lookup"]
        results = dict(zip(ours, interleave([self.steps(n, ids, temp, seed) for n in ours])))
        if "hf_prompt_lookup" in names:
            results["hf_prompt_lookup"] = hf_prompt_lookup(self.target.model, ids, self.costs.k_ng,
                                                           self.cfg.max_new_tokens, self.target.eos,
                                                           self.target.tok.pad_token_id)
        self.pool()
        return {n: results[n] for n in names}

    def pool(self) -> None:
        """Add what each policy of the turn just run measured to its method's pooled counts."""
        for name, policy in self.live.items():
            mine = self.pooled.setdefault(name, {})
            for s, (acc, jud) in policy.tally.items():
                total_acc, total_jud = mine.setdefault(s, ([0] * len(acc), [0] * len(jud)))
                for d in range(len(acc)):
                    total_acc[d] += acc[d]
                    total_jud[d] += jud[d]
        self.live = {}

    def generate(self, name: str, ids: torch.Tensor, temp: float, seed: int) -> tuple[torch.Tensor, GenerationStats]:
        """One method on one turn, alone: (new ids, stats)."""
        return self.turn([name], ids, temp, seed)[name]

    def steps(self, name: str, ids: torch.Tensor, temp: float, seed: int) -> Steps:
        """One of the decoder's methods on one turn, a pass at a time (eval.decoder.Steps)."""
        model, eos, costs, max_new = self.target.model, self.target.eos, self.costs, self.cfg.max_new_tokens
        gen = torch.Generator(device="cpu").manual_seed(seed)
        common = dict(max_new_tokens=max_new, temperature=temp, eos_token_id=eos, generator=gen)
        if name == "plain":
            # Plain decoding's passes are T(1) timed beside the drafters' passes (interleaved): they anchor the
            # price of not drafting, which a policy that drafts every pass would never time, and next to a
            # drafting pass they measure its size's ratio to T(1) whatever the machine's drift does.
            return plain_steps(model, ids, cache=self.cache_for(name, None), observe=self.learned.observe, **common)
        if name == "ngram":
            ngram = NgramDrafter()
            return speculative_steps(model, ids, ngram, costs.k_ng, policy=self.policy_for(name),
                                     cache=self.cache_for(name, ngram.capture_layers), **common)
        # Under a policy the head's commits wait while it does not draft (DeferredSync).
        drafter = HybridDrafter(self.make_head()) if name == self.subject.main and self.subject.hybrid else \
            DeferredSync(self.make_head()) if self.cfg.policy == "adaptive" else self.make_head()
        return speculative_steps(model, ids, drafter, costs.k, policy=self.policy_for(name),
                                 cache=self.cache_for(name, drafter.capture_layers), **common)

    def cache_for(self, name: str, capture: tuple[int, ...] | None) -> str | KVCache:
        """The KV cache a method's turn runs on (eval.cache): "dynamic", a fresh cache per turn; static, the
        method's own StaticKV, built on its first turn and emptied for each later one, so that on CUDA every
        verify size is captured as a graph once per eval (methods run side by side, so each needs its own)."""
        if self.cfg.cache == "dynamic":
            return "dynamic"
        if name not in self.caches:
            # room is a hint: a longer turn grows the cache (doubling, graphs recaptured)
            self.caches[name] = new_kv(self.target.model, "static", capture, room=1024)
        return self.caches[name]

    def policy_for(self, name: str) -> AdaptivePolicy | None:
        """A fresh per-request policy for a method (None: fixed k); the n-gram baseline keeps its fixed k."""
        if self.cfg.policy != "adaptive" or name in BASELINES and name != self.subject.main:
            return None
        policy = adaptive_policy(self.costs, self.learned, name.endswith("+ngram"), margin=SINGLE_STREAM_MARGIN,
                                 pooled=self.pooled.get(name))
        self.live[name] = policy
        return policy


def adaptive_policy(costs: Costs, verify: LearnedVerifyCost | Any, hybrid: bool, margin: float = 1.0,
                    pooled: dict[str, tuple[list[int], list[int]]] | None = None) -> AdaptivePolicy:
    """A fresh per-request AdaptivePolicy: the calibration's acceptance as the prior and its draft cost, per
    proposer ("head" and "ngram" for a hybrid, else "draft"); `verify` prices the passes (eval.policy); a
    draft must be predicted `margin` times faster than plain (the batch sweep's rows leave that to the gate).

    pooled: per proposer, (accepted, judged) per depth that earlier requests of the run measured, added to the
    calibration's counts before they become the prior (eval.costs.shrunk_rates). Why: a request learns its own
    acceptance from a few dozen passes, too few to pay for exploring where the head is of little use (a
    passage file at a first-depth acceptance of 0.2 and none deeper, against the calibration's 0.51 / 0.47);
    the file's earlier requests have measured it already."""
    c = costs
    cals = {"head": c.cal, "ngram": c.cal_ng} if hybrid else {"draft": c.cal}

    def prior(s: str) -> list[float]:
        st = cals[s].stats
        acc, jud = list(st.accepted_per_position), list(st.judged_per_position)
        more_acc, more_jud = (pooled or {}).get(s, ([], []))
        for d in range(min(len(acc), len(more_acc))):
            acc[d] += more_acc[d]
            jud[d] += more_jud[d]
        return measured_prior(GenerationStats(accepted_per_position=acc, judged_per_position=jud))

    return AdaptivePolicy(verify, {s: cal.draft_cost for s, cal in cals.items()}, {s: prior(s) for s in cals},
                          margin=margin)
