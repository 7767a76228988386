"""The eval stage end to end on the tiny random target: report files and keys, greedy identity, multi-turn
prompts built from the target's own answers, benchmark loading, and the refusal of another target's head.

    .venv/bin/python -m pytest -q tests/test_eval.py
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import eval.calibrate as calibrate_mod
import eval.run as run
import eval.turns as turns
from data.config import EvalConfig, TargetConfig
from data.prompts import BENCHMARK_FILES, benchmark_index
from data.readers import DataError, read_records
from eval.bench import load_questions
from eval.calibrate import CALIBRATION_FILE, free_nodes
from eval.costs import DraftCost, VerifyCost, shrunk_rates, wide_rows
from eval.decoder import GenerationStats
from eval.report import PLOTS, markdown
from eval.speedup import extend_rates
from heads import registry
from heads.base import HeadError, HeadMismatchError, save_head
from heads.dflash import DFlashConfig
from heads.eagle import Eagle3Config


def _head(tmp_path, target, name, family="eagle3"):
    """An untrained head folder for `target` (model, tok, io): acceptance is ~0, plumbing is real. EAGLE-3's by
    default; "dflash" a block drafter of 3 drafting slots."""
    _, _, io = target
    cfg = (Eagle3Config(draft_vocab_size=io.vocab_size, ttt_length=2) if family == "eagle3"
           else DFlashConfig(draft_vocab_size=io.vocab_size, block_size=4))
    torch.manual_seed(0)
    return save_head(tmp_path / name, registry.get(family).build(cfg, io), cfg, io)


def _cfg(**kw):
    base = dict(bench=["mt_bench"], max_questions=1, max_new_tokens=8, temperature=[0.0], num_draft_tokens=2,
                batch_sizes=[1, 2])
    base.update(kw)
    return EvalConfig(**base)


def test_static_cache_eval_builds_one_cache_per_method_and_stays_identical(tmp_path, tiny_target, monkeypatch):
    """eval.cache static: every method (the hybrid's trees included) runs on its own StaticKV, built on its first
    turn and reused on the next (on CUDA its graphs are captured once), and every greedy output equals plain."""
    folder = _head(tmp_path, tiny_target, "head")
    built: list[tuple[int, ...] | None] = []
    real_new_kv = turns.new_kv

    def spy(model, kind, capture=None, **kw):
        built.append(capture)
        return real_new_kv(model, kind, capture, **kw)

    monkeypatch.setattr(turns, "new_kv", spy)
    report = run.evaluate(folder, _cfg(max_new_tokens=12, cache="static"), tmp_path / "ev",
                          TargetConfig(name_or_path="tiny-random-llama"), drafter="head+ngram", loaded=tiny_target,
                          sweep_new_tokens=4, log=lambda s: None)
    b = report["benchmarks"]["mt_bench"]
    assert b["turns"] == 2 and b["identical"] is True
    assert all(b["baselines"][m]["identical"] is True for m in ("eagle3", "ngram", "hf_prompt_lookup"))
    # plain, the hybrid, the head alone and the n-gram: one cache each for both turns
    head_layers = tuple(json.loads((folder / "config.json").read_text())["layer_ids"])
    assert sorted(built, key=str) == sorted([None, head_layers, head_layers, None], key=str)
    assert report["cache"] == "static" and "static KV cache" in (tmp_path / "ev" / "report.md").read_text()


def test_head_for_another_target_is_refused(tmp_path, tiny_target, capsys):
    from data.target import load_target

    qwen = load_target(TargetConfig(name_or_path="tiny-random-qwen2", device="cpu"))
    folder = _head(tmp_path, qwen, "qwen-head")
    with pytest.raises(HeadMismatchError, match="tiny-random-qwen2.*fingerprint.*tiny-random-llama"):
        run.evaluate(folder, _cfg(), tmp_path / "ev", TargetConfig(name_or_path="tiny-random-llama"),
                     loaded=tiny_target, log=lambda s: None)
    with pytest.raises(SystemExit) as e:
        run.main(["--head", str(folder), "--target", "tiny-random-llama", "--out", str(tmp_path / "ev2")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "made for target 'tiny-random-qwen2'" in err and "tiny-random-llama" in err
    assert not (tmp_path / "ev2" / "report.json").exists()


def test_evaluate_head_writes_report(tmp_path, tiny_target, monkeypatch):
    model, tok, io = tiny_target
    folder = _head(tmp_path, tiny_target, "head")
    prompts: list[torch.Tensor] = []
    answers: list[torch.Tensor] = []
    real_plain = turns.plain_steps

    def spy(m, ids, **kw):  # plain decoding a pass at a time, as the turn loop runs it (eval.decoder.interleave)
        out = yield from real_plain(m, ids, **kw)
        prompts.append(ids[0].clone())
        answers.append(out[0].clone())
        return out

    monkeypatch.setattr(turns, "plain_steps", spy)
    out = tmp_path / "ev"
    report = run.evaluate(folder, _cfg(temperature=[0.0, 1.0]), out, TargetConfig(name_or_path="tiny-random-llama"),
                          loaded=tiny_target, sweep_new_tokens=5, log=lambda s: None)

    saved = json.loads((out / "report.json").read_text())
    b = saved["benchmarks"]["mt_bench"]
    for key in ("tau", "speedup", "acceptance_per_position"):
        assert key in b
    assert b["tau"] >= 1.0 and len(b["acceptance_per_position"]) <= 2
    sm = saved["speedup_model"]
    assert 1 <= sm["best_k"] <= 8 and set(map(str, range(1, 9))) <= set(sm["predicted"])
    assert sm["measured"]["k"] == 2 and "predicted_speedup" in sm["measured"]
    # the calibration reports its counts beside the rates it priced (pulled toward the depth above: shrunk_rates)
    cal = saved["costs"]["calibration"]
    assert cal["prompts"] == CALIBRATION_FILE.name and len(cal["judged_per_position"]) == 8
    bs = saved["batch_sweep"]
    assert [r["batch_size"] for r in bs["rows"]] == [1, 2]
    # the trained head, the hybrid and the load-aware policy run batched, each row identical to plain
    assert len(bs["methods"]) == 3 and bs["methods"][1].endswith("+ngram") and bs["policy"][bs["methods"][2]] == "load-aware"
    assert all(m["identical"] for r in bs["rows"] for m in r["methods"].values())
    assert set(bs["crossover"]) == set(bs["methods"]) and set(bs["cost_surface_ms"]) == {"1", "2"}
    # the load-aware method prices its head's drafts at the measured share of a row's own (drafted together)
    share = bs["draft_share"][bs["methods"][2]]
    assert set(share) == {"1", "2"} and share["1"] == 1.0 and 0 < share["2"] <= 1.0
    # Greedy: the head, the n-gram baseline and transformers' prompt lookup all reproduce plain decoding.
    assert b["identical"] is True
    assert b["baselines"]["ngram"]["identical"] is True
    assert b["baselines"]["hf_prompt_lookup"]["identical"] is True
    assert b["baselines"]["hf_prompt_lookup"]["tau"] is None
    # Sampling: no identity claim, no transformers baseline (greedy only).
    t1 = b["by_temperature"]["1"]
    assert t1["identical"] is None and "hf_prompt_lookup" not in t1["baselines"]
    assert report["family"] == "eagle3" and b["turns"] == 2  # one MT-bench question, two turns
    assert saved["draft_dtype"] == "float32"  # eval.draft_dtype auto: a tiny head drafts in the target's dtype
    # Turn 2's prompt is turn 1's prompt + the target's own plain answer + the second question.
    first_answer = tok.decode(answers[0].tolist(), skip_special_tokens=True)
    second_prompt = tok.decode(prompts[1].tolist())
    assert tok.decode(prompts[0].tolist()).rstrip() in second_prompt
    assert first_answer in second_prompt
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    md = (out / "report.md").read_text()
    assert "## mt_bench (temperature 0)" in md and "## mt_bench (temperature 1)" in md
    assert "counting the corrected or bonus token" in md and "Crossover (the first batch size" in md


def test_hybrid_eval_runs_the_head_alone_beside_it_and_reports_the_policy(tmp_path, tiny_target):
    folder = _head(tmp_path, tiny_target, "head")
    out = tmp_path / "ev"
    report = run.evaluate(folder, _cfg(bench=["humaneval"], max_new_tokens=16, num_draft_tokens=None,
                                       draft_dtype="bfloat16"), out,
                          TargetConfig(name_or_path="tiny-random-llama"), drafter="head+ngram", loaded=tiny_target,
                          sweep_new_tokens=4, log=lambda s: None)
    assert report["drafter"] == "eagle3+ngram" and report["policy"] == "adaptive"
    assert report["draft_dtype"] == "bfloat16"  # the head drafts in bfloat16; the outputs below stay identical
    assert report["methods"] == ["plain", "eagle3+ngram", "eagle3", "ngram", "hf_prompt_lookup"]
    b = report["benchmarks"]["humaneval"]
    assert b["identical"] is True and b["baselines"]["eagle3"]["identical"] is True
    assert set(b["chosen_k"]) == {"head", "ngram"} and set(b["baselines"]["eagle3"]["chosen_k"]) == {"draft"}
    for row in (b, b["baselines"]["eagle3"]):  # every pass chose a length, per proposer
        assert all(sum(ks.values()) == row["target_passes"] for ks in row["chosen_k"].values())
    assert sum(b["accepted_by_source"].values()) <= b["target_passes"] * (b["tau"] - 1) + 1e-9
    assert set(b["accepted_by_source"]) <= {"head", "ngram", "head+ngram"} and 0.0 <= b["draft_rate"] <= 1.0
    assert report["costs"]["ngram_calibration"]["chosen_k"] == report["ngram_k"] >= 1
    md = (out / "report.md").read_text()
    assert "## Drafting policy" in md and "| humaneval | eagle3+ngram | all |" in md and "| humaneval | eagle3 |" in md
    assert ", drafting in bfloat16," in md


def test_a_benchmark_s_earlier_turns_are_the_next_turn_s_prior(tmp_path, tiny_target, monkeypatch):
    """eval.turns pools what each method's policies measured, per benchmark: a turn's policy starts from the
    calibration's counts plus every earlier turn's of the same benchmark and method (mutant prior_never_pooled),
    and a new benchmark starts from the calibration alone."""
    made = []  # (hybrid, its pooled counts when made, the policy, the costs)
    real = turns.adaptive_policy

    def spy(costs, verify, hybrid, margin=1.0, pooled=None):
        policy = real(costs, verify, hybrid, margin, pooled)
        made.append((hybrid, None if pooled is None else {s: (list(a), list(j)) for s, (a, j) in pooled.items()},
                     policy, costs))
        return policy

    monkeypatch.setattr(turns, "adaptive_policy", spy)
    folder = _head(tmp_path, tiny_target, "head")
    run.evaluate(folder, _cfg(bench=["mt_bench", "gsm8k"], max_questions=2, max_new_tokens=12, num_draft_tokens=None,
                              batch_sizes=[1]),
                 tmp_path / "ev", TargetConfig(name_or_path="tiny-random-llama"), drafter="head", loaded=tiny_target,
                 sweep_new_tokens=2, log=lambda s: None)
    single = [m for m in made if not m[0]][:6]  # the turns' policies (the batch sweep's come after)
    assert single[0][1] is None and single[4][1] is None  # each benchmark starts from the calibration alone
    for start, end in ((0, 4), (4, 6)):  # mt_bench: 2 questions x 2 turns, then gsm8k: 2 x 1
        for i in range(start + 1, end):
            acc, jud = single[i][1]["draft"]
            earlier = [m[2].tally["draft"] for m in single[start:i]]
            assert jud == [sum(t[1][d] for t in earlier) for d in range(len(jud))]
            assert acc == [sum(t[0][d] for t in earlier) for d in range(len(acc))]
    _, pooled, policy, costs = single[3]
    assert sum(pooled["draft"][1]) > 0  # the earlier turns judged drafts
    # the prior: the calibration's counts plus the pooled ones, each depth pulled toward the one above
    st = costs.cal.stats
    acc = [a + b for a, b in zip(st.accepted_per_position, pooled["draft"][0])]
    jud = [a + b for a, b in zip(st.judged_per_position, pooled["draft"][1])]
    want = extend_rates(shrunk_rates(acc, jud), policy.k_max)
    assert policy.prior["draft"] == pytest.approx(want)


def _matrices(n_params: int) -> torch.nn.Module:
    """A stand-in head: one bias-free matrix of about n_params weights (place_head looks at nn.Linear only)."""
    side = int(n_params ** 0.5) + 1
    return torch.nn.Sequential(torch.nn.Linear(side, side, bias=False))


@pytest.mark.parametrize(("choice", "target", "n_params", "bf16_share", "timed", "want"), [
    ("auto", torch.float32, 2_000_000, 0.5, True, torch.bfloat16),  # half the time in bfloat16: kept
    ("auto", torch.float32, 2_000_000, 0.95, True, torch.float32),  # 5% faster is inside the timing's noise
    ("auto", torch.float32, 2_000_000, 1.3, True, torch.float32),  # a CPU without native bfloat16
    ("auto", torch.float32, 10_000, 0.5, False, torch.float32),  # a tiny head: untimed, the target's dtype
    ("auto", torch.bfloat16, 2_000_000, 0.5, False, torch.bfloat16),  # already a bfloat16 target
    ("target", torch.float32, 2_000_000, 0.5, False, torch.float32),
    ("bfloat16", torch.float32, 10_000, 1.3, False, torch.bfloat16),  # asked for: no timing, no size floor
])
def test_place_head_drafts_in_the_dtype_eval_draft_dtype_chooses(choice, target, n_params, bf16_share, timed, want):
    from eval.costs import place_head

    head, calls, lines = _matrices(n_params), [], []

    def timer(h, dtype, rows):
        calls.append((dtype, rows))
        assert h is head  # the head itself, on the target's device
        return 0.002 * rows * (bf16_share if dtype == torch.bfloat16 else 1.0)

    got = place_head(head, torch.device("cpu"), target, choice, lines.append, timer)
    assert got == want and {p.dtype for p in head.parameters()} == {want}
    one_row = [(torch.float32, 1), (torch.bfloat16, 1)]
    # bfloat16 chosen: the widest probe next, where it stays ahead, so no float32 rows (never widened)
    assert calls == (one_row + ([(torch.float32, 64), (torch.bfloat16, 64)] if want == torch.bfloat16 else [])
                     if timed else [])
    assert len(lines) == int(timed)
    assert wide_rows(head) is None
    if timed:
        assert lines[0].startswith(f"eval.draft_dtype auto: {str(want)[6:]} (") and "float32 2.00 ms" in lines[0]


@pytest.mark.parametrize(("crossing", "want"), [(8, 8), (4, 4), (65, None), (1, 4)])
def test_place_head_runs_wide_inputs_in_float32_from_where_float32_is_faster(crossing, want):
    """A CPU without native bfloat16: bfloat16 at half the time for one row, twice it from `crossing` rows on.
    auto drafts in bfloat16 and runs inputs of the fewest probed rows from which float32 stays faster in
    float32, from float32 weights exactly as loaded (never rounded through bfloat16)."""
    from eval.costs import place_head

    head, lines = _matrices(2_000_000), []
    weights = head[0].weight.detach().clone()

    def timer(h, dtype, rows):
        slower = 2.0 if rows >= crossing and rows > 1 else 0.5
        return 0.001 * rows * (slower if dtype == torch.bfloat16 else 1.0)

    assert place_head(head, torch.device("cpu"), torch.float32, "auto", lines.append, timer) == torch.bfloat16
    assert wide_rows(head) == want
    assert (f"float32 from {want} rows" if want else "never float32") in lines[0]
    lin = head[0]
    assert lin.weight.dtype == torch.bfloat16 and set(head.state_dict()) == {"0.weight"}
    if want:
        assert lin.wide_weight.dtype == torch.float32 and torch.equal(lin.wide_weight, weights)


def test_wide_rows_linear_runs_wide_inputs_through_its_float32_weights():
    """Below wide_rows the bfloat16 weights, from it the float32 copy (result cast back): each path equal
    to the matrix product it stands for, and the two different (bfloat16 rounds the weights)."""
    from eval.costs import widen

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    widen(lin, 4)
    lin.to(dtype=torch.bfloat16)
    assert wide_rows(lin) == 4
    for rows in (1, 3, 4, 9):
        x = torch.randn(1, rows, 64).to(torch.bfloat16)
        narrow = torch.nn.functional.linear(x, w.to(torch.bfloat16), b.to(torch.bfloat16))
        wide = torch.nn.functional.linear(x.float(), w, b).to(torch.bfloat16)
        assert not torch.equal(narrow, wide)
        assert torch.equal(lin(x), wide if rows >= 4 else narrow)


def test_place_head_refuses_an_unknown_dtype():
    from eval.costs import place_head

    with pytest.raises(ValueError, match="eval.draft_dtype must be auto, target or bfloat16, got 'float16'"):
        place_head(_matrices(100), torch.device("cpu"), torch.float32, "float16")


def test_ngram_cli_on_a_question_file(tmp_path, capsys):
    qfile = tmp_path / "my_questions.jsonl"
    qfile.write_text(
        json.dumps({"question_id": 1, "category": "copy", "turns": ["Repeat: a b c a b c a b c"]}) + "\n"
        + json.dumps({"question_id": 2, "category": "chat", "turns": ["Hi!", "And again?"]}) + "\n"
    )
    out = tmp_path / "ev"
    run.main(["--drafter", "ngram", "--target", "tiny-random-llama", "--bench", str(qfile), "--max-new-tokens", "6",
              "--batch-sizes", "1,2", "--sweep-new-tokens", "4", "--baselines", "", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    b = report["benchmarks"]["my_questions"]
    # No --k: chosen by eval.costs from the off-benchmark calibration (0 = plain is fastest -> 1 is measured).
    assert report["drafter"] == "ngram" and report["k"] == max(report["costs"]["calibration"]["chosen_k"], 1)
    assert report["k_source"].startswith("eval.costs.choose_k")
    assert set(b["categories"]) == {"copy", "chat"} and b["turns"] == 3
    assert b["identical"] is True and b["baselines"] == {}
    assert "| ngram | copy |" in capsys.readouterr().out
    assert (out / "config.yaml").is_file()


def test_bad_input_is_named(tmp_path, tiny_target):
    with pytest.raises(DataError, match="not a bundled benchmark"):
        run.evaluate(None, _cfg(bench=["nope"]), tmp_path, TargetConfig(name_or_path="tiny-random-llama"),
                     drafter="ngram", loaded=tiny_target)
    with pytest.raises(run.EvalError, match="needs --head"):
        run.evaluate(None, _cfg(), tmp_path, drafter="head")
    # (load_config refuses an unknown eval.policy: tests/test_config.py)
    with pytest.raises(run.EvalError, match="unknown baseline 'vllm'"):
        run.evaluate(None, _cfg(), tmp_path, drafter="ngram", baselines=["vllm"])
    with pytest.raises(HeadError, match="not a head folder"):
        run.evaluate(tmp_path / "missing", _cfg(), tmp_path)


def test_questions_round_robin_and_humaneval_ask():
    qs = load_questions("mt_bench", 3)
    assert [q.category for q in qs] == ["writing", "roleplay", "reasoning"]
    assert all(len(q.turns) == 2 for q in qs)
    he = load_questions("humaneval", 2)
    assert he[0].category == "humaneval" and "def has_close_elements" in he[0].turns[0]
    assert he[0].turns[0].startswith("Complete the following Python function")
    assert len(load_questions("gsm8k", 5)) == 5
    with pytest.raises(DataError, match="max_questions"):
        load_questions("gsm8k", 0)


def test_calibration_prompts_are_in_no_benchmark_and_no_bundled_training_file():
    """The adaptive policy's prior (eval.calibrate) must be measured on text the head neither trained on nor is
    tested on: the quickstart mixes GSM8K train questions into its training prompts, and the first two of them
    (the bundled tiny conversations) were the calibration once, which priced a memorised answer's deep
    acceptance as any request's."""
    bundled = CALIBRATION_FILE.parent
    index = benchmark_index(5, BENCHMARK_FILES + (bundled / "gsm8k_train.jsonl", bundled / "tiny_conversations.jsonl"))
    records, _ = read_records(CALIBRATION_FILE)
    turns = [m["content"] for r in records for m in r.messages if m["role"] == "user"]
    assert len(turns) >= 4 and len({r.id for r in records}) == len(records)
    assert max(index.max_overlap(t, both_ways=True) for t in turns) < 0.3


def test_markdown_handles_missing_values():
    rows = {"tau": None, "acceptance_per_position": [0.5, None], "tokens_per_s": 3.0, "speedup": None,
            "decode_speedup": None, "identical": None}
    report = {
        "target": "t", "drafter": "ngram", "head": None, "k": 2, "k_source": "x", "tree": "auto",
        "max_new_tokens": 4, "machine": {"device": "cpu"}, "tau_definition": "d", "speedup_definition": "s",
        "benchmarks": {"b": {"by_temperature": {"0": {**rows, "plain": {"tokens_per_s": 1.0},
                                                      "categories": {"b": rows}, "baselines": {}}}}},
        "speedup_model": {"draft_cost": {"fixed_s": 0.0, "per_token_s": 0.0}, "c": 0.0, "verify_cost_s": {"1": 0.01},
                          "acceptance_measured": [0.5], "draft_rate": 1.0, "predicted": {"1": 1.2},
                          "predicted_tau": {"1": 1.5}, "best_k": 1},
        "batch_sweep": {"methods": ["ngram"], "k": {"ngram": 2}, "policy": {"ngram": "fixed"}, "max_new_tokens": 4,
                        "tokens_per_s": "decode", "latency": "l", "rows": [], "crossover": {"ngram": None},
                        "single_stream_tau": {"ngram": 1.0}},
    }
    md = markdown(report)
    assert "0.50 / -" in md and "none in this range" in md


@pytest.mark.slow
def test_smollm2_ngram_eval(tmp_path):
    """The real SmolLM2-135M target: the report keys the quickstart relies on, greedy identity (float32)."""
    report = run.evaluate(None, _cfg(bench=["humaneval"], max_new_tokens=24, num_draft_tokens=3, batch_sizes=[1, 2]),
                          tmp_path, TargetConfig(name_or_path="smollm2-135m", device="cpu"), drafter="ngram",
                          sweep_new_tokens=8, log=lambda s: None)
    b = report["benchmarks"]["humaneval"]
    assert b["identical"] is True and b["tau"] >= 1.0 and b["speedup"] > 0
    assert report["speedup_model"]["measured"]["k"] == 3
    assert all(m["identical"] for r in report["batch_sweep"]["rows"] for m in r["methods"].values())


def _curve(ms: dict[int, float]) -> VerifyCost:
    return VerifyCost({n: t / 1000 for n, t in ms.items()}, context_len=64)


SKINNY = {1: 57, 2: 56, 3: 58, 4: 59, 5: 68, 6: 70, 7: 72, 8: 75, 9: 78, 16: 100, 32: 150, 64: 260}  # AVX2 EPYC


def test_free_nodes_are_the_draft_nodes_a_pass_verifies_for_about_the_price_of_none():
    """eval.calibrate.free_nodes: n nodes cost a pass of n + 1 tokens; a GPU-flat curve gives the cap
    (eval.tree_tokens), the skinny-kernel EPYC's (T(1..4) flat, T(5) 1.2x) 3, a Xeon's rising curve none; a dip is pooled
    (isotonic), so noise below T(1) opens no free rows past a real rise (mutant free_nodes_count_the_root)."""
    assert free_nodes(_curve(SKINNY), 60) == 3
    assert free_nodes(_curve(SKINNY), 2) == 2
    flat = _curve({n: 10.0 + n / 100 for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32, 64)})
    assert free_nodes(flat, 60) == 60 and free_nodes(flat, 10) == 10
    assert free_nodes(_curve({1: 57, 2: 68, 3: 80, 4: 90, 6: 125}), 60) == 0
    assert free_nodes(_curve({1: 60, 2: 50, 3: 64, 4: 90}), 60) == 1  # T(1) and T(2) are both ~55 ms


class _Cal:
    """What choose_tree reads of a calibration: stats (tau, nodes per pass) and the draft cost line."""

    def __init__(self, tau: float, nodes: int):
        self.stats = GenerationStats(target_passes=10, accepted_tokens=round(10 * (tau - 1)), nodes_per_pass=[nodes] * 10)
        self.draft_cost = DraftCost(0.002, 0.0)


def test_tally_counts_the_plain_answers_tokens_inside_the_draft_vocabulary():
    """Tally.vocab_coverage: per benchmark and category, the plain answers' tokens the head's t2d marks, over all
    of them (no draft can match a token outside: mutant vocab_coverage_counts_every_token); None without counts."""
    from eval.tally import Tally

    vocab = torch.tensor([True, False, True, False, False])
    tally = Tally()
    tally.add_vocab("mt_bench", "writing", torch.tensor([0, 1, 2, 3]), vocab)  # 2 of 4
    tally.add_vocab("mt_bench", "math", torch.tensor([0, 2, 2, 4, 0, 2]), vocab)  # 5 of 6
    tally.add_vocab("humaneval", "all", torch.tensor([1, 3, 4]), vocab)  # 0 of 3
    assert tally.vocab_coverage("mt_bench") == 7 / 10
    assert tally.vocab_coverage("mt_bench", "writing") == 0.5 and tally.vocab_coverage("mt_bench", "math") == 5 / 6
    assert tally.vocab_coverage("humaneval") == 0.0 and tally.vocab_coverage("gsm8k") is None


def test_eval_reports_the_draft_vocabularys_share_of_the_plain_answers(tmp_path, tiny_target):
    """report.json's benchmarks.<b>.draft_vocab_coverage (and per category, and report.md's line) is the share of
    the plain answers' tokens inside the head's draft vocabulary, recomputed here from plain decoding of both
    turns. Two heads drafting from complementary halves (even ids, odd ids) cover shares that sum to one; a head
    drafting from the whole vocabulary reports none."""
    from data.regenerate import eos_ids
    from eval.decoder import plain_generate
    from eval.turns import prompt_ids

    model, tok, io = tiny_target
    ev = _cfg(max_new_tokens=12, batch_sizes=[1])
    q = load_questions("mt_bench", 1)[0]
    answers, messages = [], []
    for turn in q.turns:
        messages.append({"role": "user", "content": turn})
        out, _ = plain_generate(model, prompt_ids(tok, messages, torch.device("cpu")), ev.max_new_tokens,
                                eos_token_id=eos_ids(model, tok))
        answers.append(out)
        messages.append({"role": "assistant", "content": tok.decode(out.tolist(), skip_special_tokens=True)})
    plain = torch.cat(answers)
    shares = []
    for parity in (0, 1):
        cfg = Eagle3Config(draft_vocab_size=io.vocab_size // 2, ttt_length=2)
        torch.manual_seed(0)
        head = registry.get("eagle3").build(cfg, io)
        ids = torch.arange(parity, io.vocab_size, 2)[: cfg.draft_vocab_size]
        head.t2d.zero_()
        head.t2d[ids] = True
        head.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
        report = run.evaluate(save_head(tmp_path / f"half{parity}", head, cfg, io), ev, tmp_path / f"ev{parity}",
                              TargetConfig(name_or_path="tiny-random-llama"), baselines=[], loaded=tiny_target,
                              sweep_new_tokens=4, log=lambda s: None)
        want = float(head.t2d[plain].float().mean())
        b = report["benchmarks"]["mt_bench"]
        assert b["draft_vocab_coverage"] == pytest.approx(want) and b["identical"] is True
        assert b["categories"][q.category]["draft_vocab_coverage"] == pytest.approx(want)
        assert f"Draft vocabulary: {want:.2f} of the plain answers' tokens" in markdown(report)
        shares.append(b["draft_vocab_coverage"])
    assert sum(shares) == pytest.approx(1.0)
    whole = run.evaluate(_head(tmp_path, tiny_target, "whole"), ev, tmp_path / "ev2",
                         TargetConfig(name_or_path="tiny-random-llama"), baselines=[], loaded=tiny_target,
                         sweep_new_tokens=4, log=lambda s: None)
    assert whole["benchmarks"]["mt_bench"]["draft_vocab_coverage"] is None


@pytest.mark.parametrize("tree_tau, want", [(1.9, "dynamic"), (1.3, "chain")])
def test_eval_tree_auto_drafts_the_tree_its_calibration_prices_above_the_chain(monkeypatch, tree_tau, want):
    """eval.tree auto (choose_tree): a tree of free_nodes(...) nodes (or of the chain's k, if more), its children
    at most eval.tree_topk, is calibrated beside the chain and replaces it only when its calibration, every pass
    drafting the whole tree priced by the measured curve, predicts more than the chain's best k (chain 1.45x
    here; the tree at tau 1.9 over 3 nodes, 2 ms of drafting and T(4) = 59 ms predicts 1.78x, at tau 1.3 1.21x;
    on the rising curve, T(4) = 90 ms, 1.18x and 0.81x against a chain's 1.05x)."""
    sized_calls: list[tuple[int, int]] = []

    def sized(topk, tokens):
        sized_calls.append((topk, tokens))
        return lambda k: ("tree", topk, tokens)

    calibrated: list[Any] = []

    def fake_calibrate(target, subject, prompts, verify):
        calibrated.append(subject.factory(8))
        return _Cal(tree_tau, 3), 3, 1.7

    monkeypatch.setattr(calibrate_mod, "calibrate_drafter", fake_calibrate)
    subject = turns.Subject("head", None, "eagle3", ["eagle3"], lambda k: ("chain", k), sized=sized)
    chain = (_Cal(1.5, 2), 2, 1.45)
    got, chosen, record = calibrate_mod.choose_tree(None, subject, EvalConfig(), [], _curve(SKINNY), chain,
                                                    log=lambda s: None)
    assert sized_calls == [(3, 3)] and calibrated == [("tree", 3, 3)]
    assert record["used"] == want and record["free_nodes"] == 3 and record["chain_predicted_speedup"] == 1.45
    if want == "dynamic":
        assert got.factory(4) == ("tree", 3, 3) and chosen[1:] == (3, 1.7)
        assert record["topk"] == 3 and record["tokens"] == 3 and abs(record["tree_predicted_speedup"] - 1.9 * 57 / 61) < 1e-9
    else:
        assert got is subject and chosen is chain
    # a curve that prices the first drafted node: a tree of the chain's own k nodes (the rows the chain was found
    # to pay for) is calibrated; a chain of one token (or none) keeps chains without calibrating a tree
    rising = _curve({1: 57, 2: 68, 3: 80, 4: 90})
    for k, tried in ((3, [(3, 3)]), (1, []), (0, [])):
        sized_calls.clear()
        calibrated.clear()
        got, chosen, record = calibrate_mod.choose_tree(None, subject, EvalConfig(), [], rising,
                                                        (chain[0], k, 1.05), log=lambda s: None)
        assert sized_calls == tried and calibrated == [("tree", 3, 3)] * len(tried)
        assert record["free_nodes"] == 0 and record["chain_k"] == k
        assert record["used"] == (want if tried else "chain") and (got is subject) == (record["used"] == "chain")


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_eval_tree_auto_reaches_the_turns_the_sweep_and_the_report(tmp_path, tiny_target, monkeypatch, family):
    """The tree eval.tree auto chose is what every head-drafting method drafts: the turns (the report's
    speedup_model sees trees of up to eval.tree_tokens nodes), the batch sweep, report.json's tree and
    costs.tree, the plan line; greedy outputs stay identical. An untrained head accepts nothing, so the
    decision is forced here (a flat verify curve, a tree priced to win; policy fixed, or no pass would draft);
    choose_tree's own test above covers it. --engine vllm compares chains, so there auto never becomes a tree
    (no sized factories). For an EAGLE-3 head and a block drafter (its dynamic tree over the block's slots)."""
    folder = _head(tmp_path, tiny_target, "head", family)
    flat = _curve({n: 1.0 for n in calibrate_mod.VERIFY_SIZES})
    monkeypatch.setattr(calibrate_mod, "measure_verify_cost", lambda *a, **kw: flat)
    monkeypatch.setattr(calibrate_mod, "ideal_speedup", lambda *a: 5.0)
    real = calibrate_mod.calibrate_drafter
    monkeypatch.setattr(calibrate_mod, "calibrate_drafter", lambda *a: (lambda c: (c[0], max(c[1], 2), 1.2))(real(*a)))
    lines: list[str] = []
    cfg = _cfg(num_draft_tokens=None, tree_tokens=3, max_new_tokens=10, batch_sizes=[1], policy="fixed")
    report = run.evaluate(folder, cfg, tmp_path / "ev", TargetConfig(name_or_path="tiny-random-llama"), baselines=[],
                          loaded=tiny_target, sweep_new_tokens=4, log=lines.append)
    assert report["tree"] == "dynamic"
    assert report["costs"]["tree"] | {"tree_predicted_speedup": None} == {
        "configured": "auto", "used": "dynamic", "free_nodes": 3, "free_node_tolerance": 0.1, "topk": 3, "tokens": 3,
        "chain_k": 2, "chain_predicted_speedup": 1.2, "tree_predicted_speedup": None}
    assert any("tree dynamic (top-3, 3 nodes; chosen by eval.tree auto)" in s for s in lines)
    b = report["benchmarks"]["mt_bench"]
    assert b["identical"] is True
    assert report["speedup_model"]["tree"]["nodes"] > 1  # the head drafted trees, not chains (no "tree" then)
    assert all(m["identical"] for r in report["batch_sweep"]["rows"] for m in r["methods"].values())
    _, vllm_subject = run._load(TargetConfig(name_or_path="tiny-random-llama"), tiny_target, folder, "head", [],
                                _cfg(num_draft_tokens=None), engine="vllm")
    assert vllm_subject.sized is None
