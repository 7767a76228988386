"""data.tokenize: the assistant-only loss mask under two chat templates, truncation, buckets, collate, cache.

The mask check decodes each run of masked tokens and compares it with the assistant turn it should be:
the answer text plus the template's end-of-turn marker (ChatML `<|im_end|>\\n`, Llama-3 `<|eot_id|>`).

    .venv/bin/python -m pytest -q tests/test_tokenize.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets
import pytest

import data.tokenize as tk
from data.config import RunConfig
from data.readers import DataError
from data.target import byte_tokenizer

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4. Ünïcode ✓ too."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
]

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def llama3_tokenizer():
    """A byte tokenizer with Llama-3's special tokens and chat template (set here, no download)."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


@pytest.mark.parametrize("make,end", [(byte_tokenizer, "<|im_end|>\n"), (llama3_tokenizer, "<|eot_id|>")],
                         ids=["chatml", "llama3"])
def test_masked_tokens_decode_to_the_assistant_turns(make, end):
    tok = make()
    ids, mask = tk.tokenize_messages(tok, CONV, max_length=4096)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert masked_runs(tok, ids, mask) == ["4. Ünïcode ✓ too." + end, "6" + end]
    # and nothing else: the unmasked tokens decode to the prompt/template part alone
    full = tok.decode(ids, skip_special_tokens=False)
    rest = tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)
    assert len(rest) == len(full) - len("4. Ünïcode ✓ too." + end + "6" + end)


def test_llama3_template_really_differs_from_chatml():
    ids, _ = tk.tokenize_messages(llama3_tokenizer(), CONV, max_length=4096)
    text = llama3_tokenizer().decode(ids, skip_special_tokens=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>")
    assert "<|im_start|>" not in text


def test_truncation_keeps_a_prefix():
    tok = byte_tokenizer()
    ids, mask = tk.tokenize_messages(tok, CONV, max_length=4096)
    short_ids, short_mask = tk.tokenize_messages(tok, CONV, max_length=70)
    assert len(short_ids) == 70 and short_ids == ids[:70] and short_mask == mask[:70]


def test_prefix_unstable_template_is_refused():
    # like some "thinking" templates: earlier assistant turns render differently once a later turn exists
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[earlier answer]\n"
        "{% else %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(DataError, match="not prefix-stable"):
        tk.tokenize_messages(tok, CONV, max_length=4096)
    ids, mask = tk.tokenize_messages(tok, CONV[:3], max_length=4096)  # one answer: stable, fine
    assert masked_runs(tok, ids, mask) == ["4. Ünïcode ✓ too.\n"]


def test_length_buckets_cut_padding_and_cover_every_sample():
    rng = random.Random(0)
    lengths = [rng.randint(10, 1000) for _ in range(500)]
    buckets = tk.length_buckets(lengths, 8, seed=3)
    assert sorted(i for b in buckets for i in b) == list(range(500))
    assert buckets == tk.length_buckets(lengths, 8, seed=3) != tk.length_buckets(lengths, 8, seed=4)
    sequential = [list(range(i, min(i + 8, 500))) for i in range(0, 500, 8)]
    bucketed, random_pad = tk.padding_fraction(buckets, lengths), tk.padding_fraction(sequential, lengths)
    assert random_pad > 0.3 and bucketed < 0.05
    ordered = tk.length_buckets(lengths, 8, seed=0, shuffle=False)
    flat = [lengths[i] for b in ordered for i in b]
    assert flat == sorted(lengths)
    assert tk.padding_fraction([[0, 1]], [5, 5]) == 0.0 and tk.padding_fraction([[0, 1]], [2, 6]) == pytest.approx(1 / 3)


def test_collate_right_pads():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    b = tk.collate(rows, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert {v.dtype for v in b.values()} == {b["input_ids"].dtype} and b["input_ids"].dtype.is_floating_point is False


def _conversations(path: Path, n: int) -> Path:
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} " * (1 + i % 5)},
                                               {"from": "gpt", "value": f"answer {i} " * (1 + i % 7)}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path: Path, data_path: Path, **kw) -> RunConfig:
    cfg = RunConfig()
    cfg.out = str(tmp_path / "run")
    cfg.data.path = str(data_path)
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.holdout_fraction = 0.25
    for k, v in kw.items():
        setattr(cfg.data, k, v)
    return cfg


def test_build_datasets_split_and_summary(tmp_path):
    tok = byte_tokenizer()
    train, hold = tk.build_datasets(_cfg(tmp_path, _conversations(tmp_path / "c.jsonl", 20)), tok)
    assert isinstance(train, datasets.Dataset) and set(train.column_names) == {"id", "input_ids", "loss_mask", "length"}
    assert len(train) == 15 and len(hold) == 5 and not set(train["id"]) & set(hold["id"])
    assert all(len(i) == n for i, n in zip(train["input_ids"], train["length"]))
    s = tk.summarize(train, hold, batch_size=4, seed=0)
    assert s["train_conversations"] == 15 and s["holdout_conversations"] == 5
    assert s["train_tokens"] == sum(train["length"]) and 0 < s["assistant_fraction"] < 1
    assert s["padding_fraction_bucketed"] <= s["padding_fraction_random"]


def test_conversations_without_answer_tokens_after_truncation_are_dropped(tmp_path):
    tok = byte_tokenizer()
    ds = tk.tokenize_records([{"id": "a", "messages": CONV[1:3]}, {"id": "b", "messages": CONV[:2]}], tok, 4096)
    assert ds["id"] == ["a"]  # b has no assistant turn
    assert len(tk.tokenize_records([{"id": "a", "messages": CONV[1:3]}], tok, 10)) == 0  # answer cut off


def test_build_datasets_reports_dropped_conversations(tmp_path, capsys):
    # prompts repeat "question i " 1 to 5 times (11 byte tokens each): with max_length 60 the longer ones
    # leave no answer token, the shorter ones keep part of theirs
    cfg = _cfg(tmp_path, _conversations(tmp_path / "c.jsonl", 10), max_length=60)
    train, hold = tk.build_datasets(cfg, byte_tokenizer())
    kept = len(train) + len(hold)
    assert 0 < kept < 10
    assert f"dropped {10 - kept} of 10 conversations with no assistant token within data.max_length=60" in (
        capsys.readouterr().err)


def test_tokenized_dataset_cache_is_reused(tmp_path, monkeypatch):
    tok = byte_tokenizer()
    cfg = _cfg(tmp_path, _conversations(tmp_path / "c.jsonl", 12))
    first, _ = tk.build_datasets(cfg, tok)
    cached = sorted((tmp_path / "cache").glob("tokenized-*.arrow"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns

    def no_tokenizing(*a, **k):
        raise AssertionError("the cached dataset was tokenized again")

    monkeypatch.setattr(tk, "tokenize_messages", no_tokenizing)
    second, _ = tk.build_datasets(cfg, tok)
    assert tk.dataset_fingerprint(second) == tk.dataset_fingerprint(first)
    assert second["id"] == first["id"]
    assert sorted((tmp_path / "cache").glob("tokenized-*.arrow")) == cached and cached[0].stat().st_mtime_ns == stamp
    # a different max length is a different key: it tokenizes again (and would fail here)
    with pytest.raises(AssertionError, match="tokenized again"):
        tk.build_datasets(_cfg(tmp_path, Path(cfg.data.path), max_length=64), tok)


def test_cli_prints_the_summary(tmp_path, capsys):
    tk.main(["--config", "configs/tiny-eagle.yaml", "--out", str(tmp_path), "--data.max_samples=8",
             "--data.holdout_fraction=0.25", "--data.max_length=4096"])
    s = json.loads(capsys.readouterr().out)
    assert s["train_conversations"] == 6 and s["holdout_conversations"] == 2
    assert list(tmp_path.joinpath("cache").glob("tokenized-*.arrow"))


@pytest.mark.slow
def test_smollm2_tokenizer_mask():
    from data.config import TargetConfig
    from data.target import load_tokenizer

    tok = load_tokenizer(TargetConfig(name_or_path="smollm2-135m"))
    ids, mask = tk.tokenize_messages(tok, CONV, max_length=4096)
    assert masked_runs(tok, ids, mask) == ["4. Ünïcode ✓ too.<|im_end|>\n", "6<|im_end|>\n"]
