"""data.prompts: user-turn prefix from two chat templates, dedup and benchmark-overlap filters, the summary,
batch-size independence and resume after a kill (tiny random target, in process and as a subprocess).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_prompts.py
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from procs import kill_when
from test_tokenize import llama3_tokenizer

import data.prompts as pr
from data.config import ConfigError, PromptsConfig, RunConfig, TargetConfig, load_config
from data.readers import DataError, read_records
from data.regenerate import Answer
from data.target import byte_tokenizer, load_model

ROOT = Path(__file__).resolve().parents[1]
# Tiny-target settings: random bytes are rarely words, so the length floors are off; short turns finish.
TINY_FLAGS = ["--target.name_or_path=tiny-random-llama", "--target.device=cpu", "--prompts.max_new_tokens=12",
              "--prompts.min_chars=0", "--prompts.min_words=0", "--prompts.num_prompts=12",
              "--prompts.mix_share=0.25", "--prompts.batch_size=4", "--prompts.max_candidates_factor=30"]


@pytest.mark.parametrize("make,ends", [(byte_tokenizer, ("<|im_start|>user\n", "<|im_end|>\n")),
                                       (llama3_tokenizer, ("<|start_header_id|>user<|end_header_id|>\n\n",
                                                           "<|eot_id|>"))], ids=["chatml", "llama3"])
def test_user_turn_prefix_is_found_from_the_template(make, ends):
    tok = make()
    for system in (None, "Hint: ask about code."):
        prefix, end = pr.user_turn_prefix(tok, system)
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hello"}]
        # prefix + content + end is exactly the template's rendering of that conversation
        assert prefix + "Hello" + end == tok.apply_chat_template(msgs, tokenize=False)
        assert prefix.endswith(ends[0]) and end == ends[1]
        assert system is None or system in prefix
    # the end-of-turn marker stops sampling (as one special token), and so does every special token
    stops = pr.stop_token_ids(tok, end)
    assert tok.convert_tokens_to_ids(end.strip()) in stops
    assert set(tok.all_special_ids) <= set(stops)
    assert tok.convert_tokens_to_ids("a") not in stops


def test_a_template_whose_prefix_depends_on_the_content_is_refused():
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] | length }}:{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(DataError, match="differently for different contents"):
        pr.user_turn_prefix(tok)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match="after a system hint"):
        pr.user_turn_prefix(tok, "hint")


def test_dedup_drops_normalized_and_near_duplicates():
    filt = pr.PromptFilter(PromptsConfig(), pr.OverlapIndex(5))
    long = "Write a Python function that returns the sum of the squares of all even numbers in a list."
    assert filt.verdict(long, True) == "kept"
    assert filt.verdict("write a python function, that RETURNS the sum of the squares of all even numbers in "
                        "a list!", True) == "duplicate"  # same words, other case and punctuation
    # one word changed: 11 of its 14 five-grams are in the kept prompt
    assert filt.verdict(long.replace("even", "odd"), True) == "duplicate"
    assert filt.verdict("Explain why the sky is blue during the day but red at sunset.", True) == "kept"
    assert filt.verdict("Hi there", True) == "short"
    assert filt.verdict("A long question that the target never finished because it ran out of", False) == "unfinished"
    assert filt.verdict("Write a poem about the sea and the wind in the harbour at night.", True) == "kept"


def test_benchmark_overlap_filter_drops_benchmark_prompts():
    filt = pr.PromptFilter(PromptsConfig(), pr.benchmark_index(5))
    mt = read_records(ROOT / "data" / "bundled" / "mt_bench.jsonl")[0][0].messages[0]["content"]
    gsm = json.loads((ROOT / "data" / "bundled" / "gsm8k_test.jsonl").read_text().splitlines()[0])["question"]
    assert filt.verdict(mt, True) == "benchmark"
    assert filt.verdict("Please help me. " + mt + " Thanks a lot, and make it funny too.", True) == "benchmark"
    # a short benchmark turn inside a long prompt: few of the prompt's n-grams, all of the turn's
    turns = [m["content"] for r in read_records(ROOT / "data" / "bundled" / "mt_bench.jsonl")[0] for m in r.messages]
    short = min((t for t in turns if len(t.split()) >= 12), key=len)
    filler = " ".join(f"word{i}" for i in range(40))
    assert pr.benchmark_index(5).max_overlap(f"{filler} {short} {filler}") < 0.3
    assert filt.verdict(f"{filler} {short} {filler}", True) == "benchmark"
    assert filt.verdict(gsm.replace(".", "!"), True) == "benchmark"
    # a HumanEval stub pasted into a question is caught by its own n-grams (both ways)
    he = read_records(ROOT / "data" / "bundled" / "HumanEval.jsonl.gz")[0][3].messages[0]["content"]
    assert filt.verdict("Fix this code:\n" + he, True) == "benchmark"
    assert filt.verdict("What are good names for a small orange cat that likes to sleep all day?", True) == "kept"


def test_config_section_is_validated(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("prompts:\n  domains:\n    - name: code\n      hint: nope\n")
    with pytest.raises(ConfigError, match=r"prompts\.domains\[0\]\.hint"):
        load_config(bad)
    for override, key in [("--prompts.mix_share=1.0", "prompts.mix_share"), ("--prompts.temperature=0", "temperature"),
                          ("--prompts.max_dup_overlap=0", "max_dup_overlap")]:
        cfg = load_config(None, [override])
        with pytest.raises(DataError, match=key):
            pr.check_prompts_config(cfg.prompts)
    cfg = load_config(None, ["--prompts.domains=[{name: a}, {name: a}]"])
    with pytest.raises(DataError, match=r"domains\[1\]\.name"):
        pr.check_prompts_config(cfg.prompts)


@pytest.fixture(scope="module")
def tiny():
    return load_model(TargetConfig(name_or_path="tiny-random-llama", device="cpu")), byte_tokenizer()


def _cfg(out: Path, *flags: str) -> RunConfig:
    cfg = load_config(None, [*TINY_FLAGS, *flags])
    cfg.out = str(out)
    return cfg


def test_summary_counts_every_candidate_and_output_mixes_gsm8k(tmp_path, tiny):
    s = pr.write_prompts(_cfg(tmp_path), *tiny)
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == s["prompts"] == 12 and s["mixed"] == 3 and s["self_written"] == 9
    assert len({r["id"] for r in rows}) == 12
    mixed = [r for r in rows if r["category"] == "mix"]
    gsm = read_records(ROOT / "data" / "bundled" / "gsm8k_train.jsonl", max_samples=3)[0]
    assert sorted(r["prompt"] for r in mixed) == sorted(r.messages[0]["content"] for r in gsm)
    domains = s["domains"]
    assert sum(d["generated"] for d in domains.values()) == s["candidates"]
    assert sum(d["kept"] for d in domains.values()) == 9
    for name, d in domains.items():
        assert d["kept"] + sum(d["dropped"].values()) <= d["generated"]  # kept beyond the target are not counted
        mine = [r for r in rows if r["category"] == name]
        assert len(mine) == d["kept"]
        assert d["mean_chars"] == pytest.approx(sum(len(r["prompt"]) for r in mine) / len(mine) if mine else 0.0)
    assert json.loads((tmp_path / "prompts.summary.json").read_text()) == s
    assert "coding" in pr.format_summary(s)
    # the output is what data.regenerate reads: prompt records, one user turn each, domain as category
    recs, _ = read_records(tmp_path / "prompts.jsonl")
    assert [r.messages[0]["role"] for r in recs] == ["user"] * 12
    assert {r.meta["category"] for r in recs} <= set(domains) | {"mix"}


def test_batch_size_does_not_change_the_prompts(tmp_path, tiny):
    pr.write_prompts(_cfg(tmp_path / "b1", "--prompts.batch_size=1"), *tiny)
    pr.write_prompts(_cfg(tmp_path / "b5", "--prompts.batch_size=5"), *tiny)
    assert (tmp_path / "b1" / "prompts.jsonl").read_text() == (tmp_path / "b5" / "prompts.jsonl").read_text()


def test_resume_with_other_settings_is_refused(tmp_path, tiny):
    pr.write_prompts(_cfg(tmp_path), *tiny)
    with pytest.raises(DataError, match="prompts setting 'prompts'"):
        pr.write_prompts(_cfg(tmp_path, "--prompts.top_p=0.5"), *tiny)


def test_kill_mid_run_then_resume_equals_uninterrupted(tmp_path):
    flags = [*TINY_FLAGS, "--prompts.num_prompts=24", "--prompts.batch_size=2"]
    journal = tmp_path / "killed" / "prompts.candidates.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = kill_when([sys.executable, "-m", "data.prompts", "--out", str(tmp_path / "killed"), *flags],
                     lambda: journal.is_file() and journal.read_bytes().count(b"\n") >= 4, 120, cwd=ROOT, env=env)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (tmp_path / "killed" / "prompts.jsonl").exists()
    pr.main(["--out", str(tmp_path / "killed"), *flags])
    pr.main(["--out", str(tmp_path / "whole"), *flags])
    for name in ("prompts.jsonl", "prompts.candidates.jsonl"):
        assert (tmp_path / "killed" / name).read_text() == (tmp_path / "whole" / name).read_text()
    ids = [json.loads(line)["id"] for line in journal.read_text().splitlines()]
    assert len(ids) == len(set(ids))
    killed = json.loads((tmp_path / "killed" / "prompts.summary.json").read_text())
    whole = json.loads((tmp_path / "whole" / "prompts.summary.json").read_text())
    assert killed["candidates_resumed"] >= 4 and killed["domains"] == whole["domains"]


# ----------------------------------------------------------------------------------------------- context domains
def test_default_domains_draw_the_items_they_drew_before_context_domains_existed():
    # pinned from main 2a11ab0 (before `requests`/`passages`): the quickstart's prompt stream is unchanged
    pcfg = load_config(ROOT / "configs" / "smollm2-135m.yaml").prompts
    got = [(it.domain, it.opener, it.seed, it.request, it.passage) for it in (pr.make_item(pcfg, 0, i) for i in (0, 1, 2, 100))]
    assert got == [("roleplay", "Pretend you are", 6504776316325642008, "", None),
                   ("writing", "Write a poem about", 8604228554895778781, "", None),
                   ("math", "Tom has", 687991602068036365, "", None),
                   ("coding", "How do I", 4498864004398046877, "", None)]
    assert all("requests" not in d and "passages" not in d for d in pr._settings(load_config(None), {})["prompts"]["domains"])


def test_trim_passage_keeps_finished_sentences():
    assert pr.trim_passage("One. Two! Three? Four and") == "One. Two! Three?"
    assert pr.trim_passage("def f():\n    return 1\n    x =") == "def f():\n    return 1"
    assert pr.trim_passage("no end at all") == ""


def _passage_flags(path: Path, weight: float = 1.0) -> list[str]:
    return [f"--prompts.domains=[{{name: ctx, weight: {weight}, requests: ['Summarise the text above.', "
            f"'What is the main point of the text above?'], passages: '{path}'}}]"]


def test_supplied_passages_make_passage_then_request_prompts(tmp_path, tiny):
    passages = [f"Passage {i}: the river town of Elm{i} grew wheat, kept {i} mills and traded salt by boat."
                for i in range(40)]
    gsm = read_records(ROOT / "data" / "bundled" / "gsm8k_test.jsonl", max_samples=1)[0][0].messages[0]["content"]
    src = tmp_path / "passages.txt"
    src.write_text("\n\n".join([gsm] * 10 + passages) + "\n")  # a benchmark question, often drawn
    s = pr.write_prompts(_cfg(tmp_path / "out", *_passage_flags(src), "--prompts.mix_share=0"), *tiny)
    rows = [json.loads(line) for line in (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {r["category"] for r in rows} == {"ctx"}
    for r in rows:
        passage, request = r["prompt"].rsplit("\n\n", 1)
        assert passage in passages and request in ("Summarise the text above.",
                                                   "What is the main point of the text above?")
    assert s["generated_tokens"] == 0  # nothing sampled: every passage came from the file
    # the same filters: a benchmark question as the passage is dropped, a repeated passage is a near-duplicate
    dropped = s["domains"]["ctx"]["dropped"]
    assert dropped.get("duplicate", 0) > 0 and dropped.get("benchmark", 0) > 0
    # JSONL passages read the same
    jsonl = tmp_path / "passages.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in [gsm] * 10 + passages))
    pr.write_prompts(_cfg(tmp_path / "out2", *_passage_flags(jsonl), "--prompts.mix_share=0"), *tiny)
    assert (tmp_path / "out2" / "prompts.jsonl").read_text() == (tmp_path / "out" / "prompts.jsonl").read_text()
    # an edited passages file is not mixed into a resumed run
    src.write_text("\n\n".join(passages[::-1]) + "\n")
    with pytest.raises(DataError, match="prompts setting 'prompts'"):
        pr.write_prompts(_cfg(tmp_path / "out", *_passage_flags(src), "--prompts.mix_share=0"), *tiny)


def test_a_request_holding_passage_places_the_passage_there():
    assert pr.context_prompt("def f(x):\n", "Complete it.\n\n```python\n{passage}```") == \
        "Complete it.\n\n```python\ndef f(x):\n```"
    assert pr.context_prompt("Some text.", "Summarise the text above.") == "Some text.\n\nSummarise the text above."


def test_bundled_code_stubs_are_stubs_and_no_benchmark():
    """data/bundled/python_stubs.jsonl (scripts/make_code_stubs.py): each passage is a function cut after its
    docstring (it parses once a body is added and has none before), none overlaps a benchmark prompt or the eval's
    calibration prompts (a training file the calibration ran on would measure recall, tests/test_eval.py)."""
    import ast
    bundled = ROOT / "data" / "bundled"
    cfg = load_config(None, [f"--prompts.domains=[{{name: s, requests: ['{{passage}}'], "
                             f"passages: '{bundled / 'python_stubs.jsonl'}'}}]"]).prompts
    stubs = pr.read_passages(cfg)[0]["s"]
    bench = pr.benchmark_index(cfg.ngram, pr.BENCHMARK_FILES + (bundled / "calibration_prompts.jsonl",))
    assert len(stubs) == 400
    for stub in stubs:
        fn = ast.parse(stub + "\n    pass\n").body[0]
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn) and len(fn.body) == 2
        assert bench.max_overlap(stub, both_ways=True) < cfg.max_bench_overlap


def test_sampled_passages_are_trimmed_not_dropped(tmp_path, tiny, monkeypatch):
    # every sampled text is cut off at max_new_tokens: a plain domain drops them all, a context domain keeps
    # each one's finished sentences and appends the request
    def cut(model, tokenizer, texts, *a, **k):
        return [Answer(f"Fact {i} about boats. Half a sente", 7, False) for i, _ in enumerate(texts)]
    monkeypatch.setattr(pr, "generate_texts", cut)
    one = ["--prompts.mix_share=0", "--prompts.num_prompts=2", "--prompts.max_dup_overlap=1.0",
           "--prompts.max_candidates_factor=1"]
    plain = pr.write_prompts(_cfg(tmp_path / "plain", "--prompts.domains=[{name: p}]", *one), *tiny)
    assert plain["self_written"] == 0 and plain["domains"]["p"]["dropped"] == {"unfinished": 2}
    s = pr.write_prompts(_cfg(tmp_path / "ctx", "--prompts.domains=[{name: c, requests: ['Translate the text "
                              "above into French.']}]", *one), *tiny)
    rows = [json.loads(line) for line in (tmp_path / "ctx" / "prompts.jsonl").read_text().splitlines()]
    assert s["self_written"] == 2 and s["generated_tokens"] == 14
    assert sorted(r["prompt"] for r in rows) == [f"Fact {i} about boats.\n\nTranslate the text above into French."
                                                 for i in (0, 1)]


def test_context_domain_errors_name_the_key(tmp_path, tiny):
    for flags, match in [
        (["--prompts.domains=[{name: c, passages: p.txt}]"], r"domains\[0\]\.passages needs .*requests"),
        (["--prompts.domains=[{name: c, requests: ['']}]"], r"domains\[0\]\.requests"),
    ]:
        with pytest.raises(DataError, match=match):
            pr.check_prompts_config(load_config(None, flags).prompts)
    with pytest.raises(DataError, match=r"prompts\.domains\[0\]\.passages: cannot read"):
        pr.write_prompts(_cfg(tmp_path / "a", *_passage_flags(tmp_path / "missing.txt")), *tiny)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a passage"):
        pr.write_prompts(_cfg(tmp_path / "b", *_passage_flags(bad)), *tiny)
    assert not (tmp_path / "b" / "prompts.candidates.jsonl").exists()  # refused before anything is written
