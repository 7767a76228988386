"""Benchmark questions for the eval stage: the bundled sets by name, or any question file a user brings.

Bundled names (files under data/bundled/, read with data.readers):
  mt_bench   data/bundled/mt_bench.jsonl         80 two-turn questions, 8 categories
  humaneval  data/bundled/HumanEval.jsonl.gz     164 Python function stubs (one turn, wrapped in an ask)
  gsm8k      data/bundled/gsm8k_test.jsonl       1319 grade-school math questions (one turn)
Anything else is read as a file path in any format data.readers understands (MT-bench format:
`question_id`, `category`, `turns`); its benchmark name is the file stem.

`--max-questions N` takes questions round-robin over categories (first of each category, then the second
of each, ...) so a small N still covers several MT-bench categories instead of N writing prompts.

    python -m eval.bench mt_bench humaneval --max-questions 4     # print what would be asked
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from data.cli import cli_main
from data.readers import DataError, read_records

_ROOT = Path(__file__).resolve().parent.parent
BUNDLED: dict[str, Path] = {
    "mt_bench": _ROOT / "data" / "bundled" / "mt_bench.jsonl",
    "humaneval": _ROOT / "data" / "bundled" / "HumanEval.jsonl.gz",
    "gsm8k": _ROOT / "data" / "bundled" / "gsm8k_test.jsonl",
}

# HumanEval records are bare code stubs; a chat model is asked to complete them (the usual chat-eval ask).
_HUMANEVAL_ASK = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


@dataclass
class Question:
    """One benchmark question: user turns, answered one after another in one conversation."""

    bench: str
    id: str
    category: str
    turns: list[str]


def bench_name(spec: str) -> str:
    """The report name of a `--bench` entry: the bundled name itself, or a file's stem."""
    if spec in BUNDLED:
        return spec
    name = Path(spec).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _round_robin(questions: list[Question], limit: int | None) -> list[Question]:
    """The first `limit` questions taken one per category in turn, categories in first-seen order.

    Example: categories [w, w, r, r, m] with limit 3 -> [w1, r1, m1]; limit 4 -> [w1, r1, m1, w2].
    """
    if limit is None or limit >= len(questions):
        return questions
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    out: list[Question] = []
    depth = 0
    while len(out) < limit:
        for qs in by_cat.values():
            if depth < len(qs) and len(out) < limit:
                out.append(qs[depth])
        depth += 1
    return out


def load_questions(spec: str, max_questions: int | None = None) -> list[Question]:
    """Questions of one benchmark (bundled name or file path); raises DataError naming the file."""
    if max_questions is not None and max_questions < 1:
        raise DataError(f"eval.max_questions must be >= 1, got {max_questions}")
    name = bench_name(spec)
    path = BUNDLED.get(spec, Path(spec))
    if spec not in BUNDLED and not path.is_file():
        raise DataError(
            f"--bench '{spec}': not a bundled benchmark ({', '.join(BUNDLED)}) and no such file"
        )
    records, _ = read_records(path)
    out: list[Question] = []
    for rec in records:
        turns = [m["content"] for m in rec.messages if m["role"] == "user"]
        if not turns:
            raise DataError(f"{path}: record {rec.id} has no user turn")
        if spec == "humaneval":
            turns = [_HUMANEVAL_ASK.format(prompt=turns[0])]
        category = rec.meta.get("category", "default")
        out.append(Question(name, rec.id, name if category == "default" else category, turns))
    if not out:
        raise DataError(f"{path}: no questions")
    return _round_robin(out, max_questions)


@cli_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the benchmark questions eval.run would ask.")
    parser.add_argument("bench", nargs="+", help="bundled names (mt_bench, humaneval, gsm8k) or question files")
    parser.add_argument("--max-questions", type=int, default=None)
    args = parser.parse_args(argv)
    for spec in args.bench:
        qs = load_questions(spec, args.max_questions)
        cats = sorted({q.category for q in qs})
        print(f"{bench_name(spec)}: {len(qs)} questions, {sum(len(q.turns) for q in qs)} turns, "
              f"categories: {', '.join(cats)}")
        for q in qs:
            more = f" (+{len(q.turns) - 1} turns)" if len(q.turns) > 1 else ""
            print(f"  [{q.category}] {q.id}: {q.turns[0][:70]!r}{more}")


if __name__ == "__main__":
    main()
