"""Tokenize conversations with the tokenizer's own chat template and an assistant-only loss mask.

The mask is computed generically, with no per-model separators: for each assistant turn i we render
  P_i = template(messages[:i], add_generation_prompt=True)   (everything before the answer)
  Q_i = template(messages[:i+1])                              (up to and including the answer)
and the answer's characters are [len(P_i), len(Q_i)) of the full rendering (which must start with Q_i).
Tokens whose first character falls in such a span get loss_mask 1. The span covers the answer and the
template's end-of-turn marker (e.g. ChatML's `<|im_end|>`), which a drafter must learn to predict too.
A template whose renderings are not prefixes of each other (some "thinking" templates strip earlier
reasoning) is refused with a clear error rather than masked wrongly.

Output: a `datasets.Dataset` (Arrow, cached on disk, batched `map`) with columns
  input_ids  list[int]   the rendered conversation, truncated to data.max_length
  loss_mask  list[int]   1 on assistant tokens (see above), 0 elsewhere
  length     int         len(input_ids)

    python -m data.tokenize --config configs/tiny-eagle.yaml      # tokenize and print the summary
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from data.cli import cli_main, write_atomic
from data.config import RunConfig, parse_args
from data.readers import DataError, read_records
from data.target import load_tokenizer
from heads.base import sha256_file


def render_chat(tokenizer: Any, messages: list[dict], template: str | None = None, gen: bool = False) -> str:
    """The one chat rendering (training, prompt writing, regeneration, eval): the tokenizer's own template, or
    `template`, as text; gen adds the generation prompt (the opening of the assistant's answer)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=gen, chat_template=template
    )


def assistant_spans(tokenizer: Any, messages: list[dict], template: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character span of each assistant turn in it.

    Worked example (ChatML): messages [user "Hi", assistant "Yo"] render to
    "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nYo<|im_end|>\\n";
    P_1 ends after "assistant\\n", so the span is "Yo<|im_end|>\\n".
    """
    full = render_chat(tokenizer, messages, template, gen=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], template, gen=True) if i else ""
        upto = render_chat(tokenizer, messages[: i + 1], template, gen=False)
        if not upto.startswith(before) or not full.startswith(upto):
            raise DataError(
                "chat template is not prefix-stable (rendering a conversation prefix does not give a prefix of "
                f"the full rendering at message {i}); set data.chat_template to a template that is"
            )
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    return full, spans


def tokenize_messages(
    tokenizer: Any, messages: list[dict], max_length: int, template: str | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation; see the module docstring for the mask rule."""
    full, spans = assistant_spans(tokenizer, messages, template)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    for j, (start, _end) in enumerate(enc["offset_mapping"]):
        for s, e in spans:
            if s <= start < e:
                mask[j] = 1
                break
    return ids[:max_length], mask[:max_length]


def _data_key(cfg: RunConfig, tokenizer: Any) -> str:
    """Cache key: source file(s), reader options, tokenizer vocabulary and template, max length."""
    h = hashlib.sha256()
    p = Path(cfg.data.path)
    # a folder of JSONL files is keyed by every file in it, so editing one invalidates the cache
    files = [p] if p.is_file() else sorted(p.glob("*.jsonl*")) if p.is_dir() else []
    if files:
        for f in files:
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        h.update(cfg.data.path.encode())
    h.update(json.dumps([cfg.data.format, cfg.data.split, cfg.data.max_samples, cfg.data.skip_malformed,
                         cfg.data.max_length, cfg.data.chat_template, tokenizer.chat_template,
                         len(tokenizer), getattr(tokenizer, "name_or_path", "")]).encode())
    return h.hexdigest()[:16]


def tokenize_records(
    records: list[dict], tokenizer: Any, max_length: int, template: str | None = None,
    cache_file: str | Path | None = None,
) -> datasets.Dataset:
    """records (dicts with `id`, `messages`) -> tokenized Dataset (batched map, cached in `cache_file`).

    Conversations with no assistant token left after truncation are dropped (they teach nothing);
    `build_datasets` reports how many on stderr.
    """
    raw = datasets.Dataset.from_list([{"id": r["id"], "messages": json.dumps(r["messages"])} for r in records])

    def fn(batch: dict) -> dict:
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "length": []}
        for m in batch["messages"]:
            ids, mask = tokenize_messages(tokenizer, json.loads(m), max_length, template)
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["length"].append(len(ids))
        return out

    kwargs: dict[str, Any] = {}
    if cache_file is not None:
        Path(cache_file).parent.mkdir(parents=True, exist_ok=True)
        check_cache(Path(cache_file))
        kwargs = dict(cache_file_name=str(cache_file), load_from_cache_file=True)
    ds = raw.map(fn, batched=True, batch_size=64, remove_columns=["messages"], desc="tokenize", **kwargs)
    if cache_file is not None and not _checksum_path(Path(cache_file)).is_file():
        write_atomic(_checksum_path(Path(cache_file)), sha256_file(cache_file) + "\n")  # freshly written
    check_token_range(ds, len(tokenizer), str(cache_file or "tokenized data"))
    return ds.filter(lambda b: [sum(m) > 0 for m in b["loss_mask"]], batched=True, desc="drop empty")


def _checksum_path(cache_file: Path) -> Path:
    return cache_file.with_name(cache_file.name + ".sha256")


def check_cache(cache_file: Path) -> None:
    """Refuse a cached tokenized file whose bytes differ from the sha256 written beside it when it was made
    (altered tokens would train silently); one without a checksum (older runs) is deleted, so it is rebuilt."""
    if not cache_file.is_file():
        _checksum_path(cache_file).unlink(missing_ok=True)
        return
    recorded = _checksum_path(cache_file)
    if not recorded.is_file():
        cache_file.unlink()  # unverifiable: tokenizing again is cheap
        return
    if sha256_file(cache_file) != recorded.read_text().strip():
        raise DataError(f"{cache_file}: the tokenized cache does not match its checksum ({recorded.name}): altered "
                        f"or damaged; delete both files to tokenize again")


def check_token_range(ds: datasets.Dataset, vocab: int, where: str) -> None:
    """DataError when a token id lies outside [0, vocab) (the embedding lookup would fail deep in a forward)."""
    ids = ds.data.column("input_ids").combine_chunks().flatten()
    if len(ids) and (pc.min(ids).as_py() < 0 or pc.max(ids).as_py() >= vocab):
        raise DataError(f"{where}: token ids outside the tokenizer's vocabulary [0, {vocab})")


def build_datasets(cfg: RunConfig, tokenizer: Any) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, holdout) tokenized datasets for cfg.data; held-out share from data.holdout_fraction.

    The split is deterministic (seeded by cfg.seed); the tokenized Arrow file is cached under
    data.cache_dir (default OUT/cache) and reused when the source, tokenizer and options are unchanged.
    """
    recs, stats = read_records(cfg.data.path, cfg.data.format, cfg.data.split, cfg.data.max_samples,
                               cfg.data.skip_malformed)
    if stats.skipped:
        print(f"data: skipped {stats.skipped} malformed records, e.g. {stats.errors[0]}", file=sys.stderr)
    if not recs:
        raise DataError(f"{cfg.data.path}: no records")
    cache_dir = Path(cfg.data.cache_dir or Path(cfg.out) / "cache")
    ds = tokenize_records(
        [{"id": r.id, "messages": r.messages} for r in recs], tokenizer, cfg.data.max_length,
        cfg.data.chat_template, cache_dir / f"tokenized-{_data_key(cfg, tokenizer)}.arrow",
    )
    if len(ds) == 0:
        raise DataError(f"{cfg.data.path}: none of {len(recs)} records has an assistant turn within "
                        f"data.max_length={cfg.data.max_length} (a prompt-only file? regenerate answers first)")
    if len(ds) < len(recs):
        print(f"data: dropped {len(recs) - len(ds)} of {len(recs)} conversations with no assistant token within "
              f"data.max_length={cfg.data.max_length}", file=sys.stderr)
    if len(ds) < 2 or cfg.data.holdout_fraction <= 0:
        return ds, ds.select([])
    n_hold = max(1, round(len(ds) * cfg.data.holdout_fraction))
    order = list(range(len(ds)))
    random.Random(cfg.seed).shuffle(order)
    return ds.select(sorted(order[n_hold:])), ds.select(sorted(order[:n_hold]))


def dataset_fingerprint(ds: datasets.Dataset) -> str:
    """A content hash of the tokenized data (input_ids and loss_mask), stable across processes."""
    h = hashlib.sha256()
    ds = ds.flatten_indices()  # `ds.data` ignores a select()'s index mapping; materialise it first
    for col in ("input_ids", "loss_mask"):
        arr = ds.data.column(col).combine_chunks()
        h.update(np.asarray(arr.values, dtype=np.int64).tobytes())
        h.update(np.asarray(arr.offsets, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def length_buckets(lengths: list[int], batch_size: int, seed: int, shuffle: bool = True) -> list[list[int]]:
    """Batches of sample indices with similar lengths (less padding), in a seeded random order.

    Indices are shuffled, cut into windows of 50 batches, each window sorted by length and cut into
    batches; the batch order is then shuffled. With shuffle=False: sorted by length, in order.
    """
    idx = list(range(len(lengths)))
    rng = random.Random(seed)
    if not shuffle:
        idx.sort(key=lambda i: lengths[i])
        return [idx[i: i + batch_size] for i in range(0, len(idx), batch_size)]
    rng.shuffle(idx)
    window = batch_size * 50
    batches = []
    for w in range(0, len(idx), window):
        chunk = sorted(idx[w: w + window], key=lambda i: lengths[i])
        batches += [chunk[i: i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def padding_fraction(batches: list[list[int]], lengths: list[int]) -> float:
    """Share of padded positions when each batch is padded to its longest sample."""
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches if b)
    return 1.0 - real / padded if padded else 0.0


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows (dicts with input_ids, loss_mask) into input_ids / attention_mask / loss_mask [B, T]."""
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), t), dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[b, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        att[b, :n] = 1
        mask[b, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": mask}


def summarize(train: datasets.Dataset, holdout: datasets.Dataset, batch_size: int, seed: int) -> dict[str, Any]:
    """Counts, token totals, assistant share and the padding fraction of length-bucketed batches."""
    lengths = list(train["length"])
    masked = int(sum(sum(m) for m in train["loss_mask"]))
    tokens = int(sum(lengths))
    return {
        "train_conversations": len(train),
        "holdout_conversations": len(holdout),
        "train_tokens": tokens,
        "assistant_tokens": masked,
        "assistant_fraction": masked / max(1, tokens),
        "max_length": max(lengths) if lengths else 0,
        "padding_fraction_bucketed": padding_fraction(length_buckets(lengths, batch_size, seed), lengths),
        "padding_fraction_random": padding_fraction(
            [list(range(i, min(i + batch_size, len(lengths)))) for i in range(0, len(lengths), batch_size)], lengths
        ),
    }


@cli_main
def main(argv: list[str] | None = None) -> None:

    cfg, _ = parse_args("Tokenize the configured conversations and print a summary.", argv)
    tok = load_tokenizer(cfg.target)
    train, hold = build_datasets(cfg, tok)
    print(json.dumps(summarize(train, hold, cfg.train.batch_size, cfg.seed), indent=2))


if __name__ == "__main__":
    main()
