"""Conversation and prompt readers: ShareGPT, OpenAI `messages`, MT-bench questions, plain prompts, `datasets`.

Every reader yields `Record`s: an id and a list of chat messages `{"role": "system"|"user"|"assistant",
"content": str}`. Prompt-only formats (MT-bench, plain prompts) have user turns only; they feed
regeneration (`python -m data.regenerate`) and the eval benchmarks.

Formats (one JSON object per line; `.gz` files are read transparently):
  sharegpt  {"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}
  messages  {"messages": [{"role": "user"|"assistant"|"system", "content": "..."}]}
  mtbench   {"question_id": 81, "category": "writing", "turns": ["...", "..."]}
  qa        {"question": "...", "answer": "..."} (GSM8K): a user turn and its reference answer
  prompts   {"prompt": "..."} or {"question": "..."} or {"instruction": "..."} or {"text": "..."}
  hf        any `datasets` dataset by name or local path whose records are one of the above

A malformed record raises `DataError` naming the file and line; with `skip_malformed=True` it is skipped
and counted in `ReadStats` (never dropped silently).

    python -m data.readers data/bundled/mt_bench.jsonl      # print a summary of a file
"""

from __future__ import annotations

import gzip
import json
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.cli import UserError, cli_main

FORMATS = ("auto", "sharegpt", "messages", "mtbench", "qa", "prompts", "hf")
_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
_PROMPT_KEYS = ("prompt", "question", "instruction", "text")


class DataError(UserError, ValueError):
    """A data record or file is malformed; the message names the file and line."""


@dataclass
class Record:
    id: str
    messages: list[dict[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReadStats:
    read: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # the first few skip reasons, with file:line


def detect_format(obj: dict) -> str:
    """Which of the formats a parsed record is in (raises ValueError if none)."""
    if "conversations" in obj:
        return "sharegpt"
    if "messages" in obj:
        return "messages"
    if "turns" in obj:
        return "mtbench"
    if "question" in obj and "answer" in obj:
        return "qa"
    if any(k in obj for k in _PROMPT_KEYS):
        return "prompts"
    raise ValueError(f"unknown record format (keys: {', '.join(sorted(obj)[:8])})")


def _content(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _chat_turns(obj: dict, list_key: str, role_key: str, content_key: str, role_word: str) -> list[dict[str, str]]:
    """The turns of a ShareGPT (`conversations`/`from`/`value`) or messages (`messages`/`role`/`content`) record."""
    turns = obj.get(list_key)
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'{list_key}' must be a non-empty list")
    msgs = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or role_key not in t or content_key not in t:
            raise ValueError(f"{list_key}[{i}] needs '{role_key}' and '{content_key}'")
        role = _ROLE.get(str(t[role_key]).lower())
        if role is None:
            raise ValueError(f"{list_key}[{i}]: unknown {role_word} '{t[role_key]}'")
        msgs.append({"role": role, "content": _content(t[content_key], f"{list_key}[{i}].{content_key}")})
    return msgs


def parse_record(obj: Any, fmt: str, default_id: str) -> Record:
    """Normalise one parsed JSON object to a Record (raises ValueError with the reason)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if fmt == "auto":
        fmt = detect_format(obj)
    rid = str(obj.get("id", obj.get("question_id", obj.get("task_id", default_id))))
    if fmt == "sharegpt":
        return Record(rid, _chat_turns(obj, "conversations", "from", "value", "speaker"))
    if fmt == "messages":
        return Record(rid, _chat_turns(obj, "messages", "role", "content", "role"))
    if fmt == "mtbench":
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns:
            raise ValueError("'turns' must be a non-empty list")
        msgs = [{"role": "user", "content": _content(t, f"turns[{i}]")} for i, t in enumerate(turns)]
        return Record(rid, msgs, {"category": str(obj.get("category", "default"))})
    if fmt == "qa":
        return Record(rid, [{"role": "user", "content": _content(obj["question"], "question")},
                            {"role": "assistant", "content": _content(obj["answer"], "answer")}])
    if fmt == "prompts":
        for k in _PROMPT_KEYS:
            if k in obj:
                return Record(rid, [{"role": "user", "content": _content(obj[k], k)}],
                              {"category": str(obj.get("category", "default"))})
        raise ValueError(f"no prompt field (one of {', '.join(_PROMPT_KEYS)})")
    raise ValueError(f"unknown format '{fmt}' (known: {', '.join(FORMATS)})")


def _malformed(reason: str, skip_malformed: bool, stats: ReadStats) -> None:
    """Raise DataError for a malformed record, or count it (keeping the first few reasons) when skipping."""
    if not skip_malformed:
        raise DataError(reason)
    stats.skipped += 1
    if len(stats.errors) < 5:
        stats.errors.append(reason)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file (.gz read through gzip); DataError naming the file and line
    for bytes that are not UTF-8, and for a truncated or damaged .gz."""
    lineno = 0
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start + 1} of the "
                                    f"line)") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: truncated or damaged gzip file after line {lineno} ({e})") from None


def _iter_jsonl(path: Path, fmt: str, skip_malformed: bool, stats: ReadStats) -> Iterator[Record]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            try:
                obj = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                # json counts lines and columns inside this one line; report the column only
                raise ValueError(f"invalid JSON: {e.msg} at column {e.pos + 1}") from None
            yield parse_record(obj, fmt, f"{path.stem}-{lineno}")
            stats.read += 1
        except ValueError as e:
            _malformed(f"{path}:{lineno}: {e}", skip_malformed, stats)


def iter_records(
    path: str | Path, fmt: str = "auto", split: str = "train", skip_malformed: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[Record]:
    """Records from a JSONL file (or .jsonl.gz), a folder of them, or a `datasets` name/path."""
    stats = stats if stats is not None else ReadStats()
    if fmt not in FORMATS:
        raise DataError(f"data.format '{fmt}' is not one of {', '.join(FORMATS)}")
    p = Path(path)
    if fmt != "hf" and p.is_file():
        yield from _iter_jsonl(p, fmt, skip_malformed, stats)
        return
    if fmt != "hf" and p.is_dir() and any(p.glob("*.jsonl*")):
        for f in sorted(p.glob("*.jsonl*")):
            yield from _iter_jsonl(f, fmt, skip_malformed, stats)
        return
    if fmt != "hf" and p.suffix in (".jsonl", ".json", ".gz"):
        raise DataError(f"{p}: no such file")
    import datasets  # here, not at the top: a second of import time the JSONL-only readers never need

    try:
        ds = datasets.load_from_disk(str(p)) if p.is_dir() else datasets.load_dataset(str(path), split=split)
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        raise DataError(f"{path}: cannot load as a datasets dataset ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split]
    for i, obj in enumerate(ds):
        try:
            yield parse_record(obj, "auto", f"{p.name}-{i}")
            stats.read += 1
        except ValueError as e:
            _malformed(f"{path}[{split}] record {i}: {e}", skip_malformed, stats)


def read_records(
    path: str | Path, fmt: str = "auto", split: str = "train", max_samples: int | None = None,
    skip_malformed: bool = False,
) -> tuple[list[Record], ReadStats]:
    """All (or the first `max_samples`) records and the read statistics."""
    stats = ReadStats()
    out: list[Record] = []
    for rec in iter_records(path, fmt, split, skip_malformed, stats):
        out.append(rec)
        if max_samples is not None and len(out) >= max_samples:
            break
    return out, stats


def to_sharegpt(rec: Record) -> dict[str, Any]:
    """A Record as one ShareGPT JSON object (what regeneration writes)."""
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"id": rec.id, "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in rec.messages]}


@cli_main
def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise DataError("usage: python -m data.readers FILE [FORMAT]")
    recs, stats = read_records(args[0], args[1] if len(args) > 1 else "auto")
    turns = sum(len(r.messages) for r in recs)
    print(f"{args[0]}: {len(recs)} records, {turns} messages, {stats.skipped} skipped")


if __name__ == "__main__":
    main()
