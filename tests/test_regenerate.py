"""data.regenerate: end to end on a tiny in-process target, batch == one-at-a-time, exact resume.

    .venv/bin/python -m pytest -q tests/test_regenerate.py
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from procs import kill_when

import data.regenerate as rg
from data.config import RunConfig, TargetConfig
from data.readers import DataError, read_records
from data.target import byte_tokenizer, load_model

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    {"prompt": "Hi"},
    {"question": "What is two plus two, really?"},
    {"question_id": 7, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
    {"id": "sg1", "conversations": [{"from": "system", "value": "Be brief."},
                                    {"from": "human", "value": "Name a colour."},
                                    {"from": "gpt", "value": "DATASET ANSWER"}]},
    {"messages": [{"role": "assistant", "content": "no user turn here"}]},
    {"prompt": "A longer prompt with many more words, so the batch needs real left padding."},
    {"prompt": "x"},
    {"prompt": "Hi"},  # same text, distinct auto id
]



@pytest.fixture(scope="module")
def varied():
    """A tiny Llama whose random weights are scaled up so greedy answers vary from token to token (the
    default init repeats one byte), with a second EOS id that greedy decoding really produces, so answers
    in one batch stop at different lengths."""
    model = load_model(TargetConfig(name_or_path="tiny-random-llama", device="cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15, generator=gen)
    tok = byte_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    model.generation_config.eos_token_id = [tok.eos_token_id, int(out[0, -1])]
    return model, tok


def _write_prompts(path: Path, rows: list[dict] = PROMPTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp: Path, prompts: Path, **kw) -> RunConfig:
    cfg = RunConfig()
    cfg.target = TargetConfig(name_or_path="tiny-random-llama", device="cpu")
    cfg.out = str(tmp)
    cfg.regenerate.prompts = str(prompts)
    cfg.regenerate.num_prompts = None
    cfg.regenerate.max_new_tokens = 10
    cfg.regenerate.batch_size = 3
    for k, v in kw.items():
        setattr(cfg.regenerate, k, v)
    return cfg


def test_end_to_end_writes_sharegpt_with_the_targets_answers(tmp_path, varied):
    model, tok = varied
    prompts = _write_prompts(tmp_path / "p.jsonl")
    s = rg.regenerate(_cfg(tmp_path / "out", prompts), model, tok)
    out = Path(s["output"])
    assert out == tmp_path / "out" / "regenerated.jsonl"
    assert (tmp_path / "out" / "config.yaml").is_file()
    assert s["records"] == s["prompts_generated"] == 7 and s["prompts_resumed"] == 0
    assert s["skipped_without_user_turn"] == 1
    assert s["answers"] == 8  # 6 one-turn prompts + 2 turns of the MT-bench question
    assert s["generated_tokens"] > 0 and s["tokens_per_s"] > 0 and s["prompts_per_s"] > 0
    recs, stats = read_records(out, "sharegpt")
    assert stats.skipped == 0
    by_id = {r.id: r for r in recs}
    assert len(by_id) == 7  # the duplicate "Hi" prompt keeps its own id
    mt = by_id["7"].messages
    assert [m["role"] for m in mt] == ["user", "assistant", "user", "assistant"]
    assert [mt[0]["content"], mt[2]["content"]] == ["Write a haiku.", "Now make it rhyme."]
    sg = by_id["sg1"].messages
    assert [m["role"] for m in sg] == ["system", "user", "assistant"]
    assert sg[2]["content"] != "DATASET ANSWER"  # the dataset's answer is replaced by the target's
    # the second turn was generated after the target's OWN first answer: rerun it by hand and compare
    second = rg.generate_batch(model, tok, [mt[:3]], _cfg(tmp_path, prompts).regenerate, None)[0]
    assert second.text == mt[3]["content"]


def test_batched_greedy_equals_one_at_a_time(tmp_path, varied):
    model, tok = varied
    prompts = _write_prompts(tmp_path / "p.jsonl")
    batched = rg.regenerate(_cfg(tmp_path / "b4", prompts, batch_size=4), model, tok)
    single = rg.regenerate(_cfg(tmp_path / "b1", prompts, batch_size=1), model, tok)
    assert Path(batched["output"]).read_text() == Path(single["output"]).read_text()
    # the batch really mixes answers that stop at EOS with answers cut at max_new_tokens
    convs = [[{"role": "user", "content": r[k]}] for r in PROMPTS for k in ("prompt", "question") if k in r]
    answers = rg.generate_batch(model, tok, convs, _cfg(tmp_path, prompts).regenerate, None)
    assert {a.stopped for a in answers} == {True, False}
    assert len({a.tokens for a in answers}) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_resume_after_a_crash_gives_the_uninterrupted_file(tmp_path, varied, monkeypatch, temperature):
    model, tok = varied
    prompts = _write_prompts(tmp_path / "p.jsonl")
    kw = dict(batch_size=2, temperature=temperature, top_p=0.9)
    whole = Path(rg.regenerate(_cfg(tmp_path / "whole", prompts, **kw), model, tok)["output"]).read_text()

    real = rg.generate_batch
    calls = []

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(rg, "generate_batch", crash_on_third)
    cfg = _cfg(tmp_path / "cut", prompts, **kw)
    with pytest.raises(RuntimeError, match="killed"):
        rg.regenerate(cfg, model, tok)
    out = tmp_path / "cut" / "regenerated.jsonl"
    assert len(out.read_text().splitlines()) == 2  # the first batch only (the second is the 2-turn one)
    monkeypatch.setattr(rg, "generate_batch", real)
    s = rg.regenerate(cfg, model, tok)
    assert s["prompts_resumed"] == 2 and s["prompts_generated"] == 5
    assert out.read_text() == whole
    if temperature > 0:  # sampling really happened: the sampled file differs from the greedy one
        greedy = rg.regenerate(_cfg(tmp_path / "greedy", prompts, batch_size=2), model, tok)
        assert Path(greedy["output"]).read_text() != whole


def test_resume_cuts_a_partial_last_line(tmp_path, varied):
    model, tok = varied
    prompts = _write_prompts(tmp_path / "p.jsonl")
    cfg = _cfg(tmp_path / "out", prompts)
    out = Path(rg.regenerate(cfg, model, tok)["output"])
    whole = out.read_text()
    lines = whole.splitlines(keepends=True)
    out.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])  # killed in the middle of a write
    s = rg.regenerate(cfg, model, tok)
    assert s["prompts_resumed"] == 4 and s["prompts_generated"] == 3
    assert out.read_text() == whole
    s = rg.regenerate(cfg, model, tok)  # a finished run resumed again does nothing
    assert s["prompts_generated"] == 0 and out.read_text() == whole


def test_resume_with_other_settings_is_refused(tmp_path, varied):
    model, tok = varied
    prompts = _write_prompts(tmp_path / "p.jsonl")
    rg.regenerate(_cfg(tmp_path / "out", prompts), model, tok)
    with pytest.raises(DataError, match="max_new_tokens"):
        rg.regenerate(_cfg(tmp_path / "out", prompts, max_new_tokens=11), model, tok)
    rg.regenerate(_cfg(tmp_path / "out", prompts, batch_size=5), model, tok)  # batch size does not matter


def test_more_prompts_extend_the_file(tmp_path, varied):
    model, tok = varied
    prompts = _write_prompts(tmp_path / "p.jsonl")
    whole = Path(rg.regenerate(_cfg(tmp_path / "whole", prompts), model, tok)["output"]).read_text()
    assert rg.regenerate(_cfg(tmp_path / "grow", prompts, num_prompts=4), model, tok)["records"] == 4
    s = rg.regenerate(_cfg(tmp_path / "grow", prompts), model, tok)
    assert s["prompts_resumed"] == 4 and s["prompts_generated"] == 3
    assert Path(s["output"]).read_text() == whole


def test_bad_settings_and_empty_prompts_are_errors(tmp_path, varied):
    model, tok = varied
    prompts = _write_prompts(tmp_path / "p.jsonl")
    with pytest.raises(DataError, match="top_p"):
        rg.regenerate(_cfg(tmp_path / "o1", prompts, top_p=0.0), model, tok)
    only_answers = _write_prompts(tmp_path / "a.jsonl", [PROMPTS[4]])
    with pytest.raises(DataError, match="no prompts with a user turn"):
        rg.regenerate(_cfg(tmp_path / "o2", only_answers), model, tok)


def test_turn_seed_depends_on_id_and_turn_only():
    assert rg.turn_seed(0, "a", 0) == rg.turn_seed(0, "a", 0)
    assert len({rg.turn_seed(0, "a", 0), rg.turn_seed(0, "a", 1), rg.turn_seed(0, "b", 0),
                rg.turn_seed(1, "a", 0)}) == 4


def test_row_sampler_respects_top_p():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    picked = set()
    for seed in range(200):
        out = rg.RowSampler([seed, seed + 1000], 1.0, 0.7, torch.device("cpu"))([0, 1], scores)
        assert out.shape == (2,)
        picked.update(out.tolist())
    assert picked == {0, 1}  # 0.5 + 0.3 reaches top_p 0.7, so tokens 2 and 3 are never drawn


def test_row_sampler_draws_a_row_from_its_own_generator():
    scores = torch.zeros(1, 50)
    alone = rg.RowSampler([7], 1.0, 1.0, torch.device("cpu"))
    among = rg.RowSampler([3, 7], 1.0, 1.0, torch.device("cpu"))
    # row 1 of a batch whose row 0 has finished draws what the same seed draws alone
    assert [int(alone([0], scores)) for _ in range(5)] == [int(among([1], scores)) for _ in range(5)]


def test_sampled_rows_that_finish_early_leave_the_others_unchanged(varied):
    """Rows stop at different steps and leave the batch (and its KV cache); every row's answer must still
    equal the one it gets generated alone, with the same seed."""
    model, tok = varied
    texts = rg.render_texts(tok, [[{"role": "user", "content": c}] for c in
                                  ("Hi", "Tell me a story.", "2+2?", "Name a colour.", "Why?")])
    stops = [tok.convert_tokens_to_ids(c) for c in "eat"]  # common bytes: sampled rows stop at varied steps
    seeds = [11, 12, 13, 14, 15]
    batched = rg.generate_texts(model, tok, texts, 24, 1.0, 1.0, seeds, stops)
    single = [rg.generate_texts(model, tok, [t], 24, 1.0, 1.0, [s], stops)[0] for t, s in zip(texts, seeds)]
    assert batched == single
    assert len({a.tokens for a in batched}) > 2 and {a.stopped for a in batched} == {True, False}


def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl", [{"prompt": f"Question number {i}?"} for i in range(10)])
    flags = [f"--regenerate.prompts={prompts}", "--regenerate.batch_size=1", "--regenerate.max_new_tokens=16",
             "--regenerate.num_prompts=null", "--target.name_or_path=tiny-random-llama", "--target.device=cpu"]
    out = tmp_path / "killed" / "regenerated.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = kill_when([sys.executable, "-m", "data.regenerate", "--out", str(tmp_path / "killed"), *flags],
                     lambda: out.is_file() and out.read_bytes().count(b"\n") >= 2, 120, cwd=ROOT, env=env)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert 2 <= out.read_bytes().count(b"\n") < 10
    rg.main(["--out", str(tmp_path / "killed"), *flags])
    rg.main(["--out", str(tmp_path / "whole"), *flags])
    text = out.read_text()
    assert text == (tmp_path / "whole" / "regenerated.jsonl").read_text()
    ids = [json.loads(line)["id"] for line in text.splitlines()]
    assert len(ids) == len(set(ids)) == 10


@pytest.mark.slow
def test_smollm2_answers_bundled_gsm8k_prompts(tmp_path):
    cfg = RunConfig()
    cfg.target = TargetConfig(name_or_path="smollm2-135m", device="cpu")
    cfg.out = str(tmp_path)
    cfg.regenerate.num_prompts, cfg.regenerate.batch_size, cfg.regenerate.max_new_tokens = 4, 4, 24
    s = rg.regenerate(cfg)
    assert s["records"] == 4 and s["answers"] == 4 and s["generated_tokens"] > 4
    recs, _ = read_records(s["output"], "sharegpt")
    assert all(len(r.messages) == 2 and len(r.messages[1]["content"]) > 10 for r in recs)
    assert "Natalia" in recs[0].messages[0]["content"]
