"""The eval's tallies: stats per method, benchmark and category, and the report sections made from them.

    tally = Tally(); tally.add("plain", "mt_bench", "writing", stats, identical=None)
    report["benchmarks"] = benchmarks_section(runs, methods, questions, temperatures)
    report["speedup_model"] = speedup_section(runs[0][1], main, costs)

Called by eval.run.evaluate (python -m eval.run); eval.turns fills the tallies turn by turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from eval.bench import Question
from eval.costs import ideal_speedup
from eval.decoder import GenerationStats
from eval.speedup import speedup_model

if TYPE_CHECKING:
    import torch

    from eval.calibrate import Costs

BASELINES = ("ngram", "hf_prompt_lookup")


def summary(stats: GenerationStats | None, plain: GenerationStats, identical: list[bool]) -> dict[str, Any]:
    """One table row: a speculative method's stats against the plain run of the same turns."""
    if stats is None:
        return {}
    out: dict[str, Any] = {
        "tau": stats.tau,
        "acceptance_per_position": stats.acceptance_rates,
        "tokens_per_s": stats.tokens_per_s,
        "plain_tokens_per_s": plain.tokens_per_s,
        "speedup": stats.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s > 0 else None,
        "decode_speedup": decode_rate(stats) / decode_rate(plain) if decode_rate(plain) > 0 else None,
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


def decode_rate(stats: GenerationStats) -> float:
    """Decode tokens/s: the prefill's token and time left out (what the speedup model predicts)."""
    t = stats.decode_time_s
    return (stats.new_tokens - stats.generations) / t if t > 0 else 0.0


class Tally:
    """Stats per method and per (benchmark, category) for one temperature."""

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str, str], GenerationStats] = {}
        self.identical: dict[tuple[str, str, str], list[bool]] = {}
        # per (benchmark, category): plain answer tokens inside the head's draft vocabulary, and all of them
        self.vocab: dict[tuple[str, str], list[int]] = {}

    def add(self, method: str, bench: str, cat: str, stats: GenerationStats, identical: bool | None) -> None:
        key = (method, bench, cat)
        self.stats[key] = self.stats[key].merge(stats) if key in self.stats else stats
        if identical is not None:
            self.identical.setdefault(key, []).append(identical)

    def add_vocab(self, bench: str, cat: str, plain_ids: torch.Tensor, vocab: torch.Tensor) -> None:
        """Count one plain answer's tokens inside the draft vocabulary (`vocab`: the head's t2d mask)."""
        counts = self.vocab.setdefault((bench, cat), [0, 0])
        counts[0] += int(vocab[plain_ids.cpu()].sum())
        counts[1] += plain_ids.numel()

    def vocab_coverage(self, bench: str, cat: str | None = None) -> float | None:
        """The share of the plain answers' tokens inside the head's draft vocabulary: no draft can match a token
        outside it (a humaneval answer that loops on a string the target misspells had 33% inside: the head
        drafted on few of its passes). None where the head drafts from the whole vocabulary, or without a head."""
        inside = total = 0
        for (b, c), (i, n) in self.vocab.items():
            if b == bench and (cat is None or c == cat):
                inside, total = inside + i, total + n
        return inside / total if total else None

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
        return {cat: summary(self.merged(method, bench, cat), self.merged("plain", bench, cat),
                              self.identical_all(method, bench, cat))
                | {"draft_vocab_coverage": self.vocab_coverage(bench, cat)}
                for cat in sorted({c for (m, b, c) in self.stats if b == bench and m == method})}

    def table(self, methods: Sequence[str], bench: str) -> dict[str, Any]:
        """benchmarks.<bench> for this temperature: the evaluated method's row, categories, baselines."""
        plain = self.merged("plain", bench)
        main = methods[0]
        row = summary(self.merged(main, bench), plain, self.identical_all(main, bench))
        row["draft_vocab_coverage"] = self.vocab_coverage(bench)
        row["categories"] = self.categories(main, bench)
        row["plain"] = {"tokens_per_s": plain.tokens_per_s, "new_tokens": plain.new_tokens, "turns": plain.generations}
        row["baselines"] = {m: summary(self.merged(m, bench), plain, self.identical_all(m, bench))
                            for m in methods[1:] if self.merged(m, bench) is not None}
        for m, r in row["baselines"].items():
            if m not in BASELINES:  # the head alone beside head+ngram: its policy per category too
                r["categories"] = self.categories(m, bench)
        if "hf_prompt_lookup" in row["baselines"]:
            # generate() does not expose its passes: no tau or acceptance for it (not 1.0, which would lie).
            row["baselines"]["hf_prompt_lookup"].update(tau=None, acceptance_per_position=None, target_passes=None,
                                                        mean_nodes_per_pass=None)
        return row


def benchmarks_section(runs: list[tuple[str, Tally]], methods: list[str], questions: dict[str, list[Question]],
                       temperatures: list[float]) -> dict[str, Any]:
    """report.json's `benchmarks`: the first temperature's tables on top, every temperature's below."""
    by_temp = {t: {b: tally.table(methods, b) for b in questions} for t, tally in runs}
    t0 = f"{temperatures[0]:g}"
    return {b: {**by_temp[t0][b], "temperature": temperatures[0],
                "by_temperature": {t: by_temp[t][b] for t in by_temp}} for b in questions}


def speedup_section(tally: Tally, main: str, costs: Costs) -> dict[str, Any]:
    """report.json's `speedup_model` over every benchmark of the first temperature, predicted against measured."""
    all_main = tally.merged(main)
    all_plain = tally.merged("plain")
    assert all_main is not None and all_plain is not None  # every turn ran both
    k, verify, draft_cost = costs.k, costs.verify, costs.cal.draft_cost
    nodes = sum(all_main.nodes_per_pass) / max(len(all_main.nodes_per_pass), 1)
    is_chain = max(all_main.nodes_per_pass, default=0) <= k
    measured = {"k": k, "tau": all_main.tau, "speedup": decode_rate(all_main) / decode_rate(all_plain),
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

