"""data.readers: every format (JSONL, .gz, folders, saved `datasets`), malformed records, bundled files.

    .venv/bin/python -m pytest -q tests/test_readers.py
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pytest

from data.readers import DataError, Record, detect_format, iter_records, main, read_records, to_sharegpt

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "data" / "bundled"

SHAREGPT = {"id": "c1", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                          {"from": "gpt", "value": "A"}]}
MESSAGES = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
MTBENCH = {"question_id": 81, "category": "writing", "turns": ["T1", "T2"]}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_sharegpt_messages_and_mtbench(tmp_path):
    recs, stats = read_records(_jsonl(tmp_path / "mix.jsonl", [SHAREGPT, MESSAGES, MTBENCH]))
    assert stats.read == 3 and stats.skipped == 0
    assert recs[0] == Record("c1", [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                    {"role": "assistant", "content": "A"}])
    assert recs[1].id == "mix-2"  # no id field: file stem and line number
    assert recs[1].messages == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert recs[2].id == "81" and recs[2].meta == {"category": "writing"}
    assert recs[2].messages == [{"role": "user", "content": "T1"}, {"role": "user", "content": "T2"}]


@pytest.mark.parametrize("key", ["prompt", "question", "instruction", "text"])
def test_plain_prompt_keys(tmp_path, key):
    (rec,), _ = read_records(_jsonl(tmp_path / "p.jsonl", [{key: "hello", "category": "math"}]))
    assert rec.messages == [{"role": "user", "content": "hello"}] and rec.meta == {"category": "math"}


def test_forced_format_rejects_other_records(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [MESSAGES])
    with pytest.raises(DataError, match=r"p\.jsonl:1: 'conversations' must be a non-empty list"):
        read_records(path, "sharegpt")
    with pytest.raises(DataError, match="data.format 'csv'"):
        read_records(path, "csv")


def test_gzip_and_folder(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps(SHAREGPT) + "\n")
    _jsonl(tmp_path / "b.jsonl", [MTBENCH])
    (gz,), _ = read_records(tmp_path / "a.jsonl.gz")
    assert gz.id == "c1"
    recs, stats = read_records(tmp_path)  # a folder: every *.jsonl* file, sorted by name
    assert [r.id for r in recs] == ["c1", "81"] and stats.read == 2


def test_datasets_saved_to_disk(tmp_path):
    datasets.Dataset.from_list([SHAREGPT, SHAREGPT | {"id": "c2"}]).save_to_disk(str(tmp_path / "ds"))
    recs, _ = read_records(tmp_path / "ds")
    assert [r.id for r in recs] == ["c1", "c2"] and recs[1].messages[2]["content"] == "A"
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([MESSAGES]),
                               "test": datasets.Dataset.from_list([{"prompt": "held out"}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    (rec,), _ = read_records(tmp_path / "dd", split="test")
    assert rec.messages == [{"role": "user", "content": "held out"}]
    datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": None}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"bad\[train\] record 1: prompt must be a string, got NoneType"):
        read_records(tmp_path / "bad")
    recs, stats = read_records(tmp_path / "bad", skip_malformed=True)
    assert len(recs) == 1 and stats.skipped == 1


def test_missing_paths_are_errors(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="cannot load as a datasets dataset"):
        read_records(tmp_path / "no-such-dataset")


BAD_LINES = [
    ('{"prompt": ', "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"foo": 1}', "unknown record format"),
    ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown speaker 'alien'"),
    ('{"conversations": [{"from": "human"}]}', "needs 'from' and 'value'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "content must be a string"),
    ('{"turns": []}', "'turns' must be a non-empty list"),
]


@pytest.mark.parametrize("line,reason", BAD_LINES)
def test_malformed_line_names_file_and_line(tmp_path, line, reason):
    path = _jsonl(tmp_path / "d.jsonl", [MESSAGES, "", line, MESSAGES])
    with pytest.raises(DataError) as e:
        read_records(path)
    assert str(e.value).startswith(f"{path}:3: ") and reason in str(e.value)


def test_skip_malformed_counts_every_skip(tmp_path):
    lines = [MESSAGES] + [bad for bad, _ in BAD_LINES] + [MTBENCH]
    recs, stats = read_records(_jsonl(tmp_path / "d.jsonl", lines), skip_malformed=True)
    assert len(recs) == 2 and stats.read == 2
    assert stats.skipped == len(BAD_LINES)
    assert len(stats.errors) == 5 and stats.errors[0].startswith(f"{tmp_path / 'd.jsonl'}:2: invalid JSON")


def test_max_samples_and_lazy_iteration(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [MESSAGES, MESSAGES, "not json"])
    recs, _ = read_records(path, max_samples=2)  # stops before the bad line
    assert len(recs) == 2
    it = iter_records(path)
    assert next(it).messages[0]["content"] == "Q"


def test_detect_format():
    assert [detect_format(o) for o in (SHAREGPT, MESSAGES, MTBENCH, {"question": "q"})] == [
        "sharegpt", "messages", "mtbench", "prompts"]
    with pytest.raises(ValueError, match="keys: a, b"):
        detect_format({"b": 1, "a": 2})


def test_to_sharegpt_round_trip(tmp_path):
    recs, _ = read_records(_jsonl(tmp_path / "a.jsonl", [SHAREGPT, MESSAGES]))
    back, _ = read_records(_jsonl(tmp_path / "b.jsonl", [to_sharegpt(r) for r in recs]), "sharegpt")
    assert [(r.id, r.messages) for r in back] == [(r.id, r.messages) for r in recs]


def test_bundled_files():
    mt, _ = read_records(BUNDLED / "mt_bench.jsonl")
    assert len(mt) == 80 and all(len(r.messages) == 2 for r in mt)
    assert len({r.meta["category"] for r in mt}) == 8
    he, _ = read_records(BUNDLED / "HumanEval.jsonl.gz")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def has_close_elements" in he[0].messages[0]["content"]
    tiny, _ = read_records(BUNDLED / "tiny_conversations.jsonl")
    assert len(tiny) == 48 and sum(len(r.messages) == 4 for r in tiny) == 12
    gsm, stats = read_records(BUNDLED / "gsm8k_train.jsonl", max_samples=64)
    assert len(gsm) == 64 and stats.skipped == 0 and gsm[0].id == "gsm8k_train-1"


def test_cli_summary_and_error(tmp_path, capsys):
    main([str(BUNDLED / "mt_bench.jsonl")])
    assert "80 records, 160 messages, 0 skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([str(_jsonl(tmp_path / "d.jsonl", ["{"]))])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'd.jsonl'}:1: invalid JSON: Expecting property name enclosed in double quotes at column 2"
