"""data.regenerate at scale without vLLM: shards + merge and data-parallel copies equal one run; engine checks.

    .venv/bin/python -m pytest -q tests/test_regenerate_scale.py
(The same paths through vLLM: tests/test_vllm.py, marked vllm.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import data.regenerate as rg
from data.config import RunConfig, TargetConfig
from data.readers import DataError

PROMPTS = [{"prompt": f"Question number {i}?"} for i in range(7)] + [
    {"question_id": 7, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]}]


def _cfg(tmp: Path, prompts: Path, **kw) -> RunConfig:
    cfg = RunConfig()
    cfg.target = TargetConfig(name_or_path="tiny-random-llama", device="cpu")
    cfg.out = str(tmp)
    r = cfg.regenerate
    r.prompts, r.num_prompts, r.max_new_tokens, r.batch_size = str(prompts), None, 6, 2
    for k, v in kw.items():
        setattr(r, k, v)
    return cfg


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return p


@pytest.fixture(scope="module")
def target(tiny_target):
    model, tok, _ = tiny_target
    return model, tok


def test_shards_then_merge_equal_one_run(tmp_path, prompts, target):
    model, tok = target
    whole = Path(rg.regenerate(_cfg(tmp_path / "whole", prompts), model, tok)["output"]).read_text()
    out = tmp_path / "arr"
    with pytest.raises(DataError, match=r"shard-00001-of-00003\.jsonl: holds 0 of its 3 records"):
        for i in (0, 2):
            rg.regenerate(_cfg(out, prompts, num_shards=3, shard_index=i), model, tok)
        rg.merge(_cfg(out, prompts, num_shards=3))
    assert not (out / "regenerated.jsonl").exists()  # nothing written while a shard is missing
    sizes = []
    for i in range(3):
        s = rg.regenerate(_cfg(out, prompts, num_shards=3, shard_index=i), model, tok)
        sizes.append(s["records"])
    assert sizes == [2, 3, 3]  # contiguous slices of the 8 prompts
    rg.merge(_cfg(out, prompts, num_shards=3))
    assert (out / "regenerated.jsonl").read_text() == whole
    # the merged file resumes like an uninterrupted run's: nothing left to do
    assert rg.regenerate(_cfg(out, prompts), model, tok)["prompts_generated"] == 0


def test_shard_slices_nest_for_data_parallel_copies():
    # data_parallel_size D inside shard I of N uses shards I*D+r of N*D: they must tile shard I exactly.
    for n_jobs in (0, 1, 7, 10, 101):
        for shards in (1, 2, 3, 5):
            for dp in (1, 2, 3):
                for i in range(shards):
                    coarse = range(n_jobs)[rg.shard_slice(n_jobs, i, shards)]
                    fine = [j for r in range(dp) for j in range(n_jobs)[rg.shard_slice(n_jobs, i * dp + r, shards * dp)]]
                    assert list(coarse) == fine


def test_data_parallel_copies_equal_one_run(tmp_path, prompts, target):
    model, tok = target
    whole = Path(rg.regenerate(_cfg(tmp_path / "whole", prompts), model, tok)["output"]).read_text()
    s = rg.regenerate(_cfg(tmp_path / "dp", prompts, data_parallel_size=2))
    assert s["records"] == len(PROMPTS) and s["data_parallel_size"] == 2
    assert Path(s["output"]).read_text() == whole
    assert sorted(p.name for p in (tmp_path / "dp").iterdir()) == ["config.yaml", "regenerated.jsonl",
                                                                   "regenerated.meta.json"]


def test_engine_is_part_of_the_resume_settings(tmp_path, prompts, target):
    """(load_config refuses an unknown regenerate.engine: tests/test_config.py.)"""
    model, tok = target
    with pytest.raises(DataError, match="shard_index must be in 0..num_shards-1"):
        rg.regenerate(_cfg(tmp_path / "x", prompts, num_shards=2, shard_index=2), model, tok)
    out = tmp_path / "out"
    rg.regenerate(_cfg(out, prompts, num_prompts=2), model, tok)
    with pytest.raises(DataError, match="regenerate setting 'engine' = 'hf', now 'vllm'"):
        rg.regenerate(_cfg(out, prompts, engine="vllm"), model, tok)
    # a file written before the engine setting existed was written by transformers: it resumes as hf
    meta = out / "regenerated.meta.json"
    old = json.loads(meta.read_text())
    del old["engine"]
    meta.write_text(json.dumps(old))
    assert rg.regenerate(_cfg(out, prompts), model, tok)["records"] == len(PROMPTS)
