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
For every turn all methods run back to back, the first method rotating from turn to turn, so machine
noise hits plain and speculative decoding alike:
  plain             token-by-token decoding (eval.decoder.plain_generate), the speedup reference
  head | ngram | head+ngram   the drafter under evaluation through the exact speculative decoder; head+ngram
                    is the head's tree with the n-gram proposal merged in as extra branches
                    (eval.drafters.HybridDrafter), and then the head alone runs beside it as well
  ngram             baseline: prompt lookup through the same decoder at its own calibrated k (fixed)
  hf_prompt_lookup  baseline: transformers' own prompt-lookup assisted generation at that k (greedy turns only)
With eval.policy "adaptive" (the default) the head-based methods (and the n-gram when it is the drafter
under evaluation) choose every pass's draft length per request (eval.policy.AdaptivePolicy: calibrated
acceptance as the prior, the measured T(n) and draft cost), down to plain passes; "fixed" drafts k every pass.
tau is tokens per target forward pass counting the corrected or bonus token (SGLang's accept_length,
EAGLE's tau); tokens/s and speedup are end to end per turn (prefill included); decode_speedup leaves
prefill out and is what the speedup model predicts. Outputs in --out: report.json, report.md, *.png,
config.yaml (see eval/report.py). The batch-size sweep (eval/batch.py) runs once at the end.

Without a GPU the CLI runs torch on ONE thread unless --threads says otherwise: batch-1 decoding is
overhead-bound, and on a 2-core machine shared with other jobs two threads stall each other (the tiny
target's single-token pass measured 3-360 ms with 2 threads under load, 3-16 ms with 1), which would
drown the plain-vs-speculative comparison in noise. The thread count is recorded in report.json.

--engine vllm (the `vllm` extra; EAGLE-3 heads) also serves the exported head in vLLM on the same turns
and writes benchmarks.<name>.vllm: vLLM's acceptance per position, mean acceptance length, tokens/s with
and without speculation, and its agreement with the built-in decoder (eval/vllm_engine.py).

From Python (train/*.py with train.eval_at_end): `evaluate(head_dir, cfg.eval, out_dir, cfg.target)`.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from data.cli import UserError, cli_main
from data.config import EvalConfig, RunConfig, TargetConfig, parse_args, save_config, to_dict
from data.readers import read_records
from data.regenerate import eos_ids
from data.target import load_target
from eval.batch import sweep
from eval.bench import Question, bench_name, load_questions
from eval.costs import Calibration, VerifyCost, calibrate, choose_k, ideal_speedup, measure_verify_cost
from eval.decoder import GenerationStats, plain_generate, speculative_generate
from eval.drafters import DeferredSync, HybridDrafter, NgramDrafter
from eval.policy import AdaptivePolicy, LearnedVerifyCost, measured_prior
from eval.report import markdown, write_report
from eval.speedup import speedup_model
from eval.vllm_engine import ServeError, check_servable, served_sections  # imports vllm only when serving
from heads import registry
from heads.base import Drafter, load_head, read_head_config

BASELINES = ("ngram", "hf_prompt_lookup")
DRAFTERS = ("head", "ngram", "head+ngram")
POLICIES = ("adaptive", "fixed")
TAU_DEFINITION = "tokens per target forward pass, counting the corrected or bonus token (prefill excluded)"
_Served = dict[tuple[str, str], list[tuple[list[int], int]]]  # (temperature, bench) -> [(prompt ids, seed)]


class EvalError(UserError, ValueError):
    """Bad eval input (flags, head folder, benchmark); the CLI prints it on one line and exits 2."""


# ----------------------------------------------------------------------------------------------- costs
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32, 64)  # tokens per target pass measured for T(n)
# k is tuned on prompts that are in no benchmark (GSM8K *train* questions), never on the test questions.
CALIBRATION_FILE = Path(__file__).resolve().parent.parent / "data" / "bundled" / "tiny_conversations.jsonl"


def calibration_prompts(tok: Any, device: torch.device, n: int = 2) -> list[torch.Tensor]:
    """The first user turn of the first n bundled training conversations, chat-templated."""
    records, _ = read_records(CALIBRATION_FILE, max_samples=n)
    return [_render(tok, [next(m for m in r.messages if m["role"] == "user")], device) for r in records]


@dataclass
class _Costs:
    """What the cost stage measured and chose: the verify curve, both calibrations, the draft lengths."""

    verify: VerifyCost
    cal: Calibration  # the drafter under evaluation, at k = 8
    cal_ng: Calibration  # the n-gram's (the same one when the n-gram is the drafter under evaluation)
    best_k: int  # choose_k's draft length for the drafter (0: plain decoding predicted fastest)
    best_speedup: float  # and the speedup it predicts
    ngram_best_k: int  # choose_k's draft length for the n-gram, at least 1
    k: int  # the draft length the eval runs: eval.num_draft_tokens, else max(best_k, 1)
    k_ng: int  # the n-gram baseline's (k itself when the n-gram is the drafter under evaluation)

    def section(self) -> dict[str, Any]:
        """report.json's `costs`."""
        cal, cal_ng = self.cal, self.cal_ng
        return {
            "verify_s": {str(n): v for n, v in self.verify.seconds.items()},
            "verify_context_tokens": self.verify.context_len,
            "draft_cost": {"fixed_s": cal.draft_cost.fixed_s, "per_token_s": cal.draft_cost.per_token_s},
            "calibration": {"prompts": str(CALIBRATION_FILE.name), "acceptance_per_position": cal.acceptance,
                            "draft_rate": cal.draft_rate, "chosen_k": self.best_k,
                            "predicted_speedup": self.best_speedup},
            "ngram_calibration": {"acceptance_per_position": cal_ng.acceptance, "draft_rate": cal_ng.draft_rate,
                                  "draft_cost": {"fixed_s": cal_ng.draft_cost.fixed_s,
                                                 "per_token_s": cal_ng.draft_cost.per_token_s},
                                  "chosen_k": self.ngram_best_k},
        }


# ----------------------------------------------------------------------------------------------- metrics
def _summary(stats: GenerationStats | None, plain: GenerationStats, identical: list[bool]) -> dict[str, Any]:
    """One table row: a speculative method's stats against the plain run of the same turns."""
    if stats is None:
        return {}
    out: dict[str, Any] = {
        "tau": stats.tau,
        "acceptance_per_position": stats.acceptance_rates,
        "tokens_per_s": stats.tokens_per_s,
        "plain_tokens_per_s": plain.tokens_per_s,
        "speedup": stats.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s > 0 else None,
        "decode_speedup": _decode_rate(stats) / _decode_rate(plain) if _decode_rate(plain) > 0 else None,
        "new_tokens": stats.new_tokens,
        "target_passes": stats.target_passes,
        "mean_nodes_per_pass": (sum(stats.nodes_per_pass) / len(stats.nodes_per_pass)) if stats.nodes_per_pass else 0.0,
        "turns": stats.generations,
        "identical": (all(identical) if identical else None),
        # What the drafting policy did: passes per chosen draft length (per proposer; 0 = a plain pass),
        # the share of passes that verified any draft, and accepted draft tokens per proposer.
        "draft_rate": stats.draft_rate,
        "chosen_k": {src: {str(n): c for n, c in sorted(ks.items())} for src, ks in sorted(stats.chosen_k.items())},
        "accepted_by_source": dict(sorted(stats.accepted_by_source.items())),
    }
    return out


def _decode_rate(stats: GenerationStats) -> float:
    """Decode tokens/s: the prefill's token and time left out (what the speedup model predicts)."""
    t = stats.decode_time_s
    return (stats.new_tokens - stats.generations) / t if t > 0 else 0.0


class _Tally:
    """Stats per method and per (benchmark, category) for one temperature."""

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str, str], GenerationStats] = {}
        self.identical: dict[tuple[str, str, str], list[bool]] = {}

    def add(self, method: str, bench: str, cat: str, stats: GenerationStats, identical: bool | None) -> None:
        key = (method, bench, cat)
        self.stats[key] = self.stats[key].merge(stats) if key in self.stats else stats
        if identical is not None:
            self.identical.setdefault(key, []).append(identical)

    def merged(self, method: str, bench: str | None = None, cat: str | None = None) -> GenerationStats | None:
        out = None
        for (m, b, c), s in self.stats.items():
            if m == method and (bench is None or b == bench) and (cat is None or c == cat):
                out = s if out is None else out.merge(s)
        return out

    def identical_all(self, method: str, bench: str | None = None, cat: str | None = None) -> list[bool]:
        return [x for (m, b, c), v in self.identical.items() for x in v
                if m == method and (bench is None or b == bench) and (cat is None or c == cat)]

    def categories(self, method: str, bench: str) -> dict[str, Any]:
        return {cat: _summary(self.merged(method, bench, cat), self.merged("plain", bench, cat),
                              self.identical_all(method, bench, cat))
                for cat in sorted({c for (m, b, c) in self.stats if b == bench and m == method})}

    def table(self, methods: Sequence[str], bench: str) -> dict[str, Any]:
        """benchmarks.<bench> for this temperature: the evaluated method's row, categories, baselines."""
        plain = self.merged("plain", bench)
        main = methods[0]
        row = _summary(self.merged(main, bench), plain, self.identical_all(main, bench))
        row["categories"] = self.categories(main, bench)
        row["plain"] = {"tokens_per_s": plain.tokens_per_s, "new_tokens": plain.new_tokens, "turns": plain.generations}
        row["baselines"] = {m: _summary(self.merged(m, bench), plain, self.identical_all(m, bench))
                            for m in methods[1:] if self.merged(m, bench) is not None}
        for m, r in row["baselines"].items():
            if m not in BASELINES:  # the head alone beside head+ngram: its policy per category too
                r["categories"] = self.categories(m, bench)
        if "hf_prompt_lookup" in row["baselines"]:
            # generate() does not expose its passes: no tau or acceptance for it (not 1.0, which would lie).
            row["baselines"]["hf_prompt_lookup"].update(tau=None, acceptance_per_position=None, target_passes=None,
                                                        mean_nodes_per_pass=None)
        return row


# ----------------------------------------------------------------------------------------------- running
def _hf_prompt_lookup(model: nn.Module, ids: torch.Tensor, k: int, max_new: int, eos: list[int],
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


def _turn_seed(seed: int, bench: str, qid: str, turn: int) -> int:
    """A per-turn seed stable across processes (Python's hash() of strings is salted per process)."""
    return zlib.crc32(f"{seed}/{bench}/{qid}/{turn}".encode())


def _render(tok: Any, messages: list[dict[str, str]], device: torch.device) -> torch.Tensor:
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    return torch.tensor([list(ids)], dtype=torch.long, device=device)


@dataclass
class _Target:
    """The loaded target: model, tokenizer, TargetIO, device and the token ids that end an answer."""

    model: nn.Module
    tok: Any
    io: Any
    device: torch.device
    eos: list[int]


@dataclass
class _Subject:
    """What is evaluated: the drafter kind, the head's config (None for the n-gram alone), the methods that run."""

    drafter: str  # one of DRAFTERS
    head_cfg: Any
    main: str  # the evaluated method's name: the head's family, "<family>+ngram" or "ngram"
    methods: list[str]  # main first, then the head alone beside a hybrid, then the baselines
    factory: Callable[[int], Callable[[], Drafter]]  # draft length -> a factory of fresh drafters

    @property
    def hybrid(self) -> bool:
        return self.drafter == "head+ngram"


@dataclass
class _Turns:
    """The per-turn loop: every question turn by turn at every temperature, all methods back to back per turn.

    A later turn sees the target's own plain answer to the earlier ones; the first method rotates from turn
    to turn so machine noise and warm caches hit plain and speculative decoding alike. With `served` (a dict,
    --engine vllm) every turn's prompt ids and seed are collected per (temperature, benchmark) for vLLM.
    """

    target: _Target
    subject: _Subject
    costs: _Costs
    cfg: EvalConfig
    seed: int
    served: _Served | None
    turn_index: int = 0  # turns run so far, over every temperature: who goes first rotates with it
    make_head: Callable[[], Drafter] = field(init=False)
    learned: LearnedVerifyCost = field(init=False)  # T(n) refined by every policy's timed passes, all run long

    def __post_init__(self) -> None:
        self.make_head = self.subject.factory(self.costs.k)
        self.learned = LearnedVerifyCost(self.costs.verify)

    def run(self, questions: dict[str, list[Question]]) -> list[tuple[str, _Tally]]:
        """(temperature key, tally) per eval.temperature, in order."""
        runs = []
        n_turns = sum(len(q.turns) for qs in questions.values() for q in qs) * len(self.cfg.temperature)
        bar = tqdm(total=n_turns, desc="eval turns", unit="turn", disable=None)
        for temp in self.cfg.temperature:
            tally = _Tally()
            methods = [m for m in self.subject.methods if not (m == "hf_prompt_lookup" and temp > 0)]
            for bench, qs in questions.items():
                for q in qs:
                    self.question(q, bench, temp, methods, tally, bar)
            runs.append((f"{temp:g}", tally))
        bar.close()
        return runs

    def question(self, q: Question, bench: str, temp: float, methods: list[str], tally: _Tally,
                 bar: tqdm) -> None:
        """All turns of one question; each turn's results go into the tally."""
        tok, main = self.target.tok, self.subject.main
        messages: list[dict[str, str]] = []
        for t, turn in enumerate(q.turns):
            messages.append({"role": "user", "content": turn})
            ids = _render(tok, messages, self.target.device)
            turn_seed = _turn_seed(self.seed, bench, q.id, t)
            if self.served is not None:
                self.served.setdefault((f"{temp:g}", bench), []).append((ids[0].tolist(), turn_seed))
            order = ["plain"] + methods
            r = self.turn_index % len(order)  # rotate who goes first: noise and warm caches hit all alike
            results = {name: self.generate(name, ids, temp, turn_seed) for name in order[r:] + order[:r]}
            plain_ids = results["plain"][0]
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

    def generate(self, name: str, ids: torch.Tensor, temp: float,
                 turn_seed: int) -> tuple[torch.Tensor, GenerationStats]:
        """One method on one turn: (new ids, stats)."""
        model, eos, costs, max_new = self.target.model, self.target.eos, self.costs, self.cfg.max_new_tokens
        gen = torch.Generator(device="cpu").manual_seed(turn_seed)
        common = dict(max_new_tokens=max_new, temperature=temp, eos_token_id=eos, generator=gen)
        if name == "plain":
            return plain_generate(model, ids, **common)
        if name == "hf_prompt_lookup":
            return _hf_prompt_lookup(model, ids, costs.k_ng, max_new, eos, self.target.tok.pad_token_id)
        if name == "ngram":
            return speculative_generate(model, ids, NgramDrafter(), costs.k_ng, policy=self.policy_for(name),
                                        **common)
        # Under a policy the head's commits wait while it does not draft (DeferredSync).
        drafter = HybridDrafter(self.make_head()) if name == self.subject.main and self.subject.hybrid else \
            DeferredSync(self.make_head()) if self.cfg.policy == "adaptive" else self.make_head()
        return speculative_generate(model, ids, drafter, costs.k, policy=self.policy_for(name), **common)

    def policy_for(self, name: str) -> AdaptivePolicy | None:
        """A fresh per-request policy for a method (None: fixed k); the n-gram baseline keeps its fixed k."""
        c, main = self.costs, self.subject.main
        if self.cfg.policy != "adaptive" or name in BASELINES and name != main:
            return None
        if name.endswith("+ngram"):
            return AdaptivePolicy(self.learned, {"head": c.cal.draft_cost, "ngram": c.cal_ng.draft_cost},
                                  {"head": measured_prior(c.cal.stats), "ngram": measured_prior(c.cal_ng.stats)})
        return AdaptivePolicy(self.learned, {"draft": c.cal.draft_cost}, {"draft": measured_prior(c.cal.stats)})


# ----------------------------------------------------------------------------------------------- stages
def _check_request(cfg_eval: EvalConfig, drafter: str, head_dir: str | Path | None,
                   baselines: Sequence[str]) -> None:
    """Refuse bad flags before anything is read or loaded."""
    if drafter not in DRAFTERS:
        raise EvalError(f"--drafter must be one of {', '.join(DRAFTERS)}, got '{drafter}'")
    if drafter != "ngram" and head_dir is None:
        raise EvalError(f"--drafter {drafter} needs --head PATH (or use --drafter ngram)")
    if cfg_eval.policy not in POLICIES:
        raise EvalError(f"eval.policy must be one of {', '.join(POLICIES)}, got '{cfg_eval.policy}'")
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        raise EvalError(f"unknown baseline '{unknown[0]}' (known: {', '.join(BASELINES)})")
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
            check_servable(head_meta["family"] if head_meta else None, drafter, tree)
        except ServeError as e:
            raise EvalError(str(e)) from None


def _load(target_cfg: TargetConfig, loaded: tuple[nn.Module, Any, Any] | None, head_dir: str | Path | None,
          drafter: str, baselines: Sequence[str], tree: str) -> tuple[_Target, _Subject]:
    """The target (or the one already in memory) and the head on its device; the methods to run."""
    model, tok, io = loaded if loaded is not None else load_target(target_cfg, decode=True)
    device = next(model.parameters()).device
    head = head_cfg = None
    if head_dir is not None:
        head, head_cfg, _ = load_head(head_dir, io)  # refuses another target's head, naming why
        head.to(device=device, dtype=next(model.parameters()).dtype)  # the drafter reads the target's features
    hybrid = drafter == "head+ngram"
    name = head_cfg.family if head_cfg is not None else "head"
    main = "ngram" if drafter == "ngram" else f"{name}+ngram" if hybrid else name
    methods = [main] + ([name] if hybrid else []) + [b for b in baselines if b != main]

    def factory(k: int) -> Callable[[], Drafter]:
        # the family maps eval.tree onto its own options (HeadError, one line, for a tree it does not have)
        return NgramDrafter if drafter == "ngram" else registry.get(head_cfg.family).drafter_factory(head, io, tree, k)

    target = _Target(model, tok, io, device, eos_ids(model, tok))
    return target, _Subject(drafter, head_cfg, main, methods, factory)


def _calibrate_drafter(target: _Target, subject: _Subject, prompts: list[torch.Tensor],
                       verify: VerifyCost) -> tuple[Calibration, int, float]:
    """The evaluated drafter's calibration at k = 8, and the draft length (0 = plain) and speedup it predicts."""
    cal = calibrate(target.model, subject.factory(8)(), prompts, k=8, max_new_tokens=32, eos_token_id=target.eos)
    best_k, best_speedup = choose_k(cal.acceptance, verify, cal.draft_cost, k_max=8, draft_rate=cal.draft_rate)
    if best_k > 0 and max(cal.stats.nodes_per_pass, default=0) > 8:
        # A tree verifies more nodes than its depth, which choose_k (a chain model) does not price: re-run the
        # calibration at the chosen depth and price its real node counts; plain decoding wins if it is faster.
        check = calibrate(target.model, subject.factory(best_k)(), prompts, k=best_k, max_new_tokens=32,
                          eos_token_id=target.eos)
        best_speedup = ideal_speedup(check.stats, verify, check.draft_cost)
        if best_speedup < 1.0:
            best_k, best_speedup = 0, 1.0
    return cal, best_k, best_speedup


def _measure_costs(target: _Target, subject: _Subject, cfg_eval: EvalConfig,
                   questions: dict[str, list[Question]]) -> _Costs:
    """The verify curve T(n), the off-benchmark calibrations, and the draft lengths they choose."""
    first = next(iter(questions.values()))[0]
    context = int(_render(target.tok, [{"role": "user", "content": first.turns[0]}], target.device).shape[1])
    verify = measure_verify_cost(target.model, context_len=context, ks=VERIFY_SIZES, repeats=3)
    k = cfg_eval.num_draft_tokens
    if k is not None and k < 1:
        raise EvalError(f"eval.num_draft_tokens must be >= 1, got {k}")
    # Calibration: acceptance per depth at k = 8 and the draft cost line (fixed + per token), off-benchmark;
    # for a hybrid the head's (here) and the n-gram's (below) separately: the policy's prior per proposer.
    prompts = calibration_prompts(target.tok, target.device)
    cal, best_k, best_speedup = _calibrate_drafter(target, subject, prompts, verify)
    cal_ng = cal if subject.drafter == "ngram" else calibrate(target.model, NgramDrafter(), prompts, k=8,
                                                              max_new_tokens=32, eos_token_id=target.eos)
    k_ng = max(choose_k(cal_ng.acceptance, verify, cal_ng.draft_cost, k_max=8, draft_rate=cal_ng.draft_rate)[0], 1)
    # choose_k returns 0 when plain decoding is predicted fastest; the eval still measures k = 1 then.
    k = max(best_k, 1) if k is None else k
    return _Costs(verify, cal, cal_ng, best_k, best_speedup, ngram_best_k=k_ng, k=k,
                  k_ng=k if subject.drafter == "ngram" else k_ng)


def _plan_line(target_cfg: TargetConfig, subject: _Subject, costs: _Costs, cfg_eval: EvalConfig,
               questions: dict[str, list[Question]]) -> str:
    """The log line that says what runs, before the turns start."""
    return (f"eval: target {target_cfg.name_or_path}, drafter {subject.main}, k {costs.k} "
            f"({'config' if cfg_eval.num_draft_tokens else 'chosen from measured costs and calibration'}), "
            f"policy {cfg_eval.policy}, n-gram baseline k {costs.k_ng}, methods "
            f"{', '.join(['plain'] + subject.methods)}, benchmarks {', '.join(questions)}")


def _benchmarks(runs: list[tuple[str, _Tally]], methods: list[str], questions: dict[str, list[Question]],
                temperatures: list[float]) -> dict[str, Any]:
    """report.json's `benchmarks`: the first temperature's tables on top, every temperature's below."""
    by_temp = {t: {b: tally.table(methods, b) for b in questions} for t, tally in runs}
    t0 = f"{temperatures[0]:g}"
    return {b: {**by_temp[t0][b], "temperature": temperatures[0],
                "by_temperature": {t: by_temp[t][b] for t in by_temp}} for b in questions}


def _add_served(benchmarks: dict[str, Any], head_dir: str | Path | None, target: _Target, target_cfg: TargetConfig,
                served: _Served, runs: list[tuple[str, _Tally]],
                main: str, k: int, max_new_tokens: int, seed: int, log: Callable[[str], None]) -> None:
    """--engine vllm: serve the exported head in vLLM on the same turns: benchmarks.<name>.vllm."""
    tallies = dict(runs)
    try:
        for b, section in served_sections(head_dir, target.io, target_cfg, served,
                                          lambda t, b: tallies[t].merged(main, b), k, max_new_tokens,
                                          target.eos, seed=seed, log=log).items():
            benchmarks[b]["vllm"] = section
    except ServeError as e:
        raise EvalError(str(e)) from None


def _speedup_section(tally: _Tally, main: str, costs: _Costs) -> dict[str, Any]:
    """report.json's `speedup_model` over every benchmark of the first temperature, predicted against measured."""
    all_main = tally.merged(main)
    all_plain = tally.merged("plain")
    assert all_main is not None and all_plain is not None  # every turn ran both
    k, verify, draft_cost = costs.k, costs.verify, costs.cal.draft_cost
    nodes = sum(all_main.nodes_per_pass) / max(len(all_main.nodes_per_pass), 1)
    is_chain = max(all_main.nodes_per_pass, default=0) <= k
    measured = {"k": k, "tau": all_main.tau, "speedup": _decode_rate(all_main) / _decode_rate(all_plain),
                "end_to_end_speedup": all_main.tokens_per_s / all_plain.tokens_per_s,
                # tau priced by the measured costs with zero loop overhead (eval.costs.ideal_speedup)
                "ideal_speedup": ideal_speedup(all_main, verify, draft_cost)}
    section = speedup_model(all_main.acceptance_rates, all_main.draft_rate, verify, draft_cost,
                            ks=sorted(set(range(1, 9)) | {k}), measured=measured,
                            tree_nodes=None if is_chain else round(nodes))
    # T(n) comes from a probe before the run; these are the same costs as the run itself saw them.
    section["in_run_verify_s"] = {
        "plain_pass": all_plain.verify_time_s / max(all_plain.target_passes, 1),
        "speculative_pass": all_main.verify_time_s / max(all_main.target_passes, 1),
        "mean_tokens_per_speculative_pass": 1 + nodes,
    }
    return section


def _batch_sweep(target: _Target, questions: dict[str, list[Question]], batch_sizes: list[int], k: int,
                 sweep_new_tokens: int, log: Callable[[str], None]) -> dict[str, Any]:
    """report.json's `batch_sweep` (eval/batch.py) on every question's first turn, n-gram drafter per row."""
    tok = target.tok
    prompts = [tok.apply_chat_template([{"role": "user", "content": q.turns[0]}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
               for qs in questions.values() for q in qs]
    log(f"batch sweep: batch sizes {batch_sizes}, n-gram drafter per row, k {k}, {sweep_new_tokens} new tokens per row")
    return sweep(target.model, prompts, tok.pad_token_id if tok.pad_token_id is not None else target.eos[0],
                 batch_sizes, k, NgramDrafter, max_new_tokens=sweep_new_tokens,
                 drafter_name="ngram (prompt lookup per row)", progress=log)


def _report(target_cfg: TargetConfig, head_dir: str | Path | None, subject: _Subject, costs: _Costs,
            cfg_eval: EvalConfig, device: torch.device, *, benchmarks: dict[str, Any], speedup: dict[str, Any],
            batch: dict[str, Any]) -> dict[str, Any]:
    """report.json: what ran and the definitions, then the measured sections, the machine and the config."""
    return {
        "target": target_cfg.name_or_path,
        "head": None if head_dir is None else str(head_dir),
        "family": None if subject.head_cfg is None else subject.head_cfg.family,
        "drafter": subject.main,
        "k": costs.k,
        "k_source": "eval.num_draft_tokens" if cfg_eval.num_draft_tokens is not None
        else "eval.costs.choose_k: calibration acceptance and draft cost, measured verify curve",
        "tree": cfg_eval.tree,
        "policy": cfg_eval.policy,
        "ngram_k": costs.k_ng,
        "tau_definition": TAU_DEFINITION,
        "speedup_definition": "speculative tokens/s over plain tokens/s of the same target on the same turns in "
                              "the same run (interleaved); end to end per turn, decode_speedup without prefill",
        "temperatures": list(cfg_eval.temperature),
        "max_new_tokens": cfg_eval.max_new_tokens,
        "methods": ["plain"] + subject.methods,
        "benchmarks": benchmarks,
        "speedup_model": speedup,
        "costs": costs.section(),
        "batch_sweep": batch,
        "machine": {"device": str(device), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "eval_config": to_dict(cfg_eval),
    }


def evaluate(
    head_dir: str | Path | None,
    cfg_eval: EvalConfig,
    out_dir: str | Path,
    target_cfg: TargetConfig | None = None,
    *,
    drafter: str = "head",
    baselines: Sequence[str] = BASELINES,
    sweep_new_tokens: int = 32,
    seed: int = 0,
    loaded: tuple[nn.Module, Any, Any] | None = None,
    log: Callable[[str], None] = print,
    engine: str = "builtin",
) -> dict[str, Any]:
    """Run the whole eval and write the report files into out_dir; returns the report dict (report.json).

    head_dir: a head folder (drafter "head" or "head+ngram"), or None with drafter "ngram" (prompt lookup alone).
    target_cfg: the target to load (default: the one named in the head's config.json; for drafter
    "ngram" without a head it is required). loaded: (model, tokenizer, TargetIO) already in memory, used
    instead of loading (the head is still checked against it). engine "vllm": also serve the head in vLLM
    (eval/vllm_engine.py). Raises HeadMismatchError for a head made
    for another target, EvalError / DataError / TargetLoadError for bad input.

    The stages, in order (each a function above):
    check the request, resolve the target, read the questions, check the engine, load target and head,
    measure costs and choose k, run every turn with every method, tabulate the benchmarks, serve in vLLM
    (--engine vllm), fit the speedup model, sweep batch sizes, assemble and write the report.
    """
    _check_request(cfg_eval, drafter, head_dir, baselines)
    head_meta, target_cfg = _resolve_target(head_dir, target_cfg)
    questions = {bench_name(b): load_questions(b, cfg_eval.max_questions) for b in cfg_eval.bench}
    _check_engine(engine, head_meta, drafter, cfg_eval.tree)
    target, subject = _load(target_cfg, loaded, head_dir, drafter, baselines, cfg_eval.tree)
    costs = _measure_costs(target, subject, cfg_eval, questions)
    log(_plan_line(target_cfg, subject, costs, cfg_eval, questions))
    served: _Served | None = {} if engine == "vllm" else None
    runs = _Turns(target, subject, costs, cfg_eval, seed, served).run(questions)
    benchmarks = _benchmarks(runs, subject.methods, questions, cfg_eval.temperature)
    if served is not None:
        _add_served(benchmarks, head_dir, target, target_cfg, served, runs, subject.main, costs.k,
                    cfg_eval.max_new_tokens, seed, log)
    speedup = _speedup_section(runs[0][1], subject.main, costs)
    batch = _batch_sweep(target, questions, cfg_eval.batch_sizes, costs.k, sweep_new_tokens, log)
    report = _report(target_cfg, head_dir, subject, costs, cfg_eval, target.device, benchmarks=benchmarks,
                     speedup=speedup, batch=batch)
    write_report(report, out_dir)
    return report


# ----------------------------------------------------------------------------------------------- CLI
def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", help="head folder (config.json + model.safetensors)")
    p.add_argument("--drafter", choices=DRAFTERS, help="what to evaluate (default: head if --head, else ngram); "
                   "head+ngram merges the n-gram proposal into the head's tree and runs the head alone beside it")
    p.add_argument("--policy", choices=POLICIES, help="adaptive: per-pass draft length from the request's acceptance "
                   "(default); fixed: k every pass")
    p.add_argument("--target", help="target name_or_path (default: the head's own target, or the config's)")
    p.add_argument("--bench", help="comma-separated: mt_bench, humaneval, gsm8k or question files")
    p.add_argument("--temperature", type=_floats, help="comma-separated temperatures, e.g. 0,1")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--max-questions", type=int)
    p.add_argument("--k", type=int, help="draft length (default: chosen from measured costs)")
    p.add_argument("--batch-sizes", type=_ints, help="batch sizes of the sweep, e.g. 1,2,4,8,16")
    p.add_argument("--sweep-new-tokens", type=int, default=32, help="tokens per row in the batch sweep")
    p.add_argument("--threads", type=int, help="torch CPU threads (default without a GPU: 1, see the module doc; "
                   "0 = torch's own choice)")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="vllm: also serve the exported head in vLLM and compare (the vllm extra; EAGLE-3)")
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help=f"comma-separated subset of {','.join(BASELINES)} (empty for none)")


@cli_main
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg, args = parse_args("Evaluate a drafter: tau, acceptance, speedup, batch sweep, reports.", argv, _flags)
    ev: EvalConfig = cfg.eval
    if args.bench:
        ev.bench = [b.strip() for b in args.bench.split(",") if b.strip()]
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
    save_config(cfg, out)
    report = evaluate(args.head, ev, out, target_cfg, drafter=drafter,
                      baselines=[b.strip() for b in args.baselines.split(",") if b.strip()],
                      sweep_new_tokens=args.sweep_new_tokens, seed=cfg.seed, engine=args.engine)
    print(markdown(report))
    print(f"wrote {out / 'report.json'}, {out / 'report.md'} and plots")


if __name__ == "__main__":
    main()
