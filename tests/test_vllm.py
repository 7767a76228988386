"""vLLM as an engine: agreement statistics (default suite) and, marked `vllm`, the real engine end to end.

    .venv/bin/python -m pytest -q tests/test_vllm.py                 # statistics and refusals, no vLLM needed
    ./scripts/setup_env.sh --extra vllm && .venv/bin/python -m pytest -q -m vllm tests/test_vllm.py   # ~5-10 min

The `vllm` tests use the packaged SmolLM2-135M (vLLM's CPU attention kernels do not take the tiny targets'
head size 16): a regeneration through vLLM SIGKILLed after its first chunk resumes to the same file as an
uninterrupted run, and `eval.run --engine vllm` with an untrained EAGLE-3 head writes benchmarks.gsm8k.vllm
(acceptance ~0 on both sides, so it checks the plumbing; a trained head's agreement is in the README) and the
engine's curve at concurrency 1 and 2 (vllm_concurrency, three engines: fixed k, plain, per-batch-size k).
The default suite checks the curve's table, crossovers and per-batch-size choice, the served k of a DFlash
export (block_size - 1), and the T > 0 engine-fault decision on planted counts.
Extraction through vLLM (`features.engine=vllm`): a run SIGKILLed after its first shard resumes to the
shards of an uninterrupted run (same sha256), `verify` passes and the report's numerics table agrees with
transformers to float32 rounding; a tolerance no engine meets is refused with one line and exit 2 before any
shard; and a planted wrong layer index (every capture one layer too deep) is refused by the numerics check.
Every subprocess runs in its own process group, killed whole on timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from procs import finish, kill_when, start

from eval.report import concurrency_lines, served_lines
from eval.vllm_engine import (
    ServeError,
    add_schedule_runs,
    agreement,
    batch_size_schedule,
    check_servable,
    concurrency_section,
    per_batch_size_k,
    served_counts,
    served_k,
    served_row,
    wilson,
)

ROOT = Path(__file__).resolve().parents[1]


def test_wilson_interval_matches_the_formula_by_hand():
    # 41/100: centre (0.41 + z^2/200) / (1 + z^2/100) = 0.4133, half-width 0.0947 (z = 1.96, by hand)
    lo, hi = wilson(41, 100)
    assert abs(lo - 0.3187) < 1e-3 and abs(hi - 0.5080) < 1e-3
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(0, 50)
    assert lo == 0.0 and 0.05 < hi < 0.08


def test_agreement_flags_a_real_difference_and_accepts_noise():
    # 200 passes each: 0.41 vs 0.40 is noise; 0.41 vs 0.20 (what a wrong layer id or norm does) is a bug.
    same = agreement([82, 40], [200, 82], [80, 38], [200, 80])
    assert same["agrees"] and [r["overlap"] for r in same["positions"]] == [True, True]
    bug = agreement([82, 40], [200, 82], [40, 20], [200, 40])
    assert not bug["agrees"] and not bug["positions"][0]["overlap"]
    # a difference at the second position alone is caught too
    deep = agreement([82, 70], [200, 82], [82, 30], [200, 82])
    assert not deep["agrees"] and [r["overlap"] for r in deep["positions"]] == [True, False]


def test_served_counts_are_conditional_like_the_builtin_decoder():
    # 100 drafts of k=3: 40 accepted the first token, 20 the first two, 5 all three -> conditional rates
    # 0.4, 0.5, 0.25 (tested at d = accepted at d-1), mean acceptance length 1 + 65/100.
    m = {"vllm:spec_decode_num_drafts": 100, "vllm:spec_decode_num_accepted_tokens": 65,
         "vllm:spec_decode_num_accepted_tokens_per_pos": [40, 20, 5]}
    drafts, accepted, per_pos, tested = served_counts(m, 3)
    assert (drafts, accepted, per_pos, tested) == (100, 65, [40, 20, 5], [100, 40, 20])
    assert served_counts(m, 2)[2:] == ([40, 20], [100, 40])


@pytest.mark.parametrize("family,drafter,tree,msg,head_config", [
    ("medusa", "head", "auto", "medusa head is not served by vLLM here", None),
    ("mtp", "head", "auto", "DeepSeek-style", None),
    ("eagle1", "head", "auto", "EAGLE-1", None),
    (None, "ngram", "auto", "needs a head", None),
    ("eagle3", "head", "dynamic", "compares chains", None),
    # a DSpark head: its family is served (DFlash's layout), but not this head (speculators_dspark only)
    ("dflash", "head", "auto", "exports to: speculators_dspark", {"sample_from_anchor": True, "markov_rank": 8}),
    ("dflash", "head", "auto", "exports to: no engine layout", {"sample_from_anchor": True, "markov_rank": 0}),
])
def test_what_vllm_does_not_serve_is_refused_before_the_eval(family, drafter, tree, msg, head_config):
    with pytest.raises(ServeError, match=msg):
        check_servable(family, drafter, tree, head_config)


def _run_at(tokens: int, seconds: float, drafts: int = 0, per_pos: tuple[int, ...] = (0, 0)) -> dict:
    """A worker's per-concurrency (or per-group) result, as vLLM's counter deltas give it."""
    return {"tokens": tokens, "seconds": seconds, "metrics": {
        "vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_accepted_tokens": sum(per_pos),
        "vllm:spec_decode_num_accepted_tokens_per_pos": list(per_pos)}}


def test_the_engine_curve_table_and_its_crossovers():
    # plain 10, 20, 40, 80, 160 tok/s; the head 15, 24, 40, 64, 144: speedups 1.5, 1.2, 1.0 (not faster), 0.8, 0.9
    sizes = [1, 2, 4, 8, 16]
    plain = [_run_at(10 * c, 1.0) for c in sizes]
    head = [_run_at(t, 1.0, drafts=100, per_pos=(40, 20)) for t in (15, 24, 40, 64, 144)]
    table = concurrency_section(sizes, head, plain, 2)
    assert [r["speedup"] for r in table["rows"]] == pytest.approx([1.5, 1.2, 1.0, 0.8, 0.9])
    assert table["crossover"] == 4  # the first concurrency NOT faster: equal counts as not faster
    assert table["rows"][0]["tau"] == pytest.approx(1.6) and table["rows"][0]["acceptance_per_position"] == [0.4, 0.5]
    ks = per_batch_size_k([(r["concurrency"], r["speedup"], r["tau"]) for r in table["rows"]], 3)
    assert ks == [3, 3, 0, 0, 0]
    assert batch_size_schedule(sizes, ks) == [[1, 1, 3], [2, 3, 3], [4, 7, 0], [8, 15, 0], [16, 16, 0]]
    # with the schedule: drafts at 1 and 2 as before, plain-like 40.5, 81, 161 tok/s (1.01x) above
    add_schedule_runs(table, [head[0], head[1], _run_at(40.5, 1.0), _run_at(81, 1.0), _run_at(161.6, 1.0)], ks, 3)
    assert [r["per_batch_k"] for r in table["rows"]] == ks and table["per_batch_crossover"] is None
    assert table["rows"][2]["per_batch_tau"] == 1.0  # no drafts at k 0
    table.update({"engine": "vllm 0.32.0", "device": "cpu", "method": "eagle3", "num_speculative_tokens": 3,
                  "max_num_seqs": 16, "prompts": 2, "max_new_tokens": 16, "tokens_per_s": "end to end",
                  "per_batch_size_schedule": batch_size_schedule(sizes, ks), "per_batch_size_rule": "rule",
                  "per_batch_size_run": "its own engine"})
    md = "\n".join(concurrency_lines(table))
    assert "| 4 | 40.0 | 40.0 | 1.00x | 1.60 | 0 | 40.5 | 1.01x | 1.00 |" in md
    assert "fixed k **4**, per-batch-size k **none in this range**" in md


def test_the_per_batch_size_choice_follows_the_curve_and_starts_at_1():
    # an unmeasured speedup (plain gave no tokens) is not a reason to draft, nor a "speedup" without acceptance
    assert per_batch_size_k([(2, 1.3, 1.4), (4, None, 1.4), (8, 0.99, 1.4), (16, 1.4, 1.0)], 2) == [2, 0, 0, 0]
    assert batch_size_schedule([2, 4, 8], [2, 0, 0]) == [[1, 3, 2], [4, 7, 0], [8, 8, 0]]
    assert batch_size_schedule([1], [0]) == [[1, 1, 0]]


class _Ours:
    """The built-in decoder's GenerationStats, as far as served_row reads it."""

    def __init__(self, accepted: list[int], judged: list[int]) -> None:
        self.accepted_per_position, self.judged_per_position = accepted, judged
        self.acceptance_rates = [a / j for a, j in zip(accepted, judged)]


def test_a_sampled_disagreement_is_an_engine_fault_and_its_numbers_are_withheld():
    ours = _Ours([82, 40], [200, 82])  # the built-in decoder: 0.41, 0.49 at T = 1 on these turns
    plain = _run_at(100, 10.0) | {"temperature": 1.0}
    # planted fault: vLLM's counts far below its own rule's (0.04 at position 1)
    faulty = _run_at(120, 10.0, drafts=200, per_pos=(8, 1)) | {"temperature": 1.0}
    row = served_row(faulty, plain, ours, 2, "cpu", "0.32.0")
    assert row["engine_fault"].startswith("vLLM's sampled acceptance 0.04 at position 1 disagrees with its own "
                                          "rule's 0.41 (built-in, same turns, T=1)")
    assert "uninitialised memory" in row["engine_fault"]
    assert row["acceptance_per_position"] is row["speedup"] is row["tokens_per_s"] is None
    assert row["mean_acceptance_length"] is None and row["accepted_per_position"] == [8, 1]  # counts kept
    md = "\n".join(served_lines({"gsm8k": {"vllm": {
        "engine": "vllm 0.32.0", "device": "cpu", "method": "eagle3", "num_speculative_tokens": 2, "eval_k": 2,
        "draft_sample_method": "probabilistic", "requests": "one at a time", "by_temperature": {"1": row}}}}))
    assert "| 1 | withheld | 0.41 / 0.49 | - | - | 10.0 | - | ENGINE FAULT: vLLM's sampled acceptance 0.04" in md
    # the greedy turns disagreeing too points at the export, still withheld
    assert "suspect the export" in served_row(faulty, plain, ours, 2, "cpu", "0.32.0", greedy_agrees=False)[
        "engine_fault"]
    # agreeing counts: no fault, the numbers stand
    fine = served_row(_run_at(120, 10.0, drafts=200, per_pos=(80, 38)) | {"temperature": 1.0}, plain, ours, 2,
                      "cpu", "0.32.0")
    assert "engine_fault" not in fine and fine["agreement"]["agrees"]
    assert fine["speedup"] == pytest.approx(1.2) and fine["acceptance_per_position"] == [0.4, 38 / 80]
    # greedy: the same disagreement is an export bug (warned by served_sections), not an engine fault
    greedy = served_row(faulty | {"temperature": 0.0}, plain, ours, 2, "cpu", "0.32.0")
    assert "engine_fault" not in greedy and not greedy["agreement"]["agrees"] and greedy["speedup"] == 1.2


def test_the_served_k_is_the_exports_own_proposal(tiny_target, tmp_path):
    # A DFlash head proposes block_size - 1 tokens whatever the eval's k; EAGLE-3 serves the eval's k.
    import torch

    from convert import export_head
    from heads import registry
    from heads.base import save_head
    from heads.dflash import DFlashConfig
    from heads.eagle import Eagle3Config

    _, _, io = tiny_target
    torch.manual_seed(0)
    dcfg = DFlashConfig(layer_ids=[1, 2, 3], draft_vocab_size=200, block_size=4, num_layers=1, anchors=3)
    native = save_head(tmp_path / "dflash", registry.get("dflash").build(dcfg, io), dcfg, io)
    assert served_k(export_head(native, "speculators_dflash", tmp_path / "d-vllm", io, speculative_tokens=2), 2) == 3
    ecfg = Eagle3Config(draft_vocab_size=200, ttt_length=1)
    native = save_head(tmp_path / "eagle3", registry.get("eagle3").build(ecfg, io), ecfg, io)
    assert served_k(export_head(native, "speculators", tmp_path / "e-vllm", io, speculative_tokens=2), 2) == 2


# ----------------------------------------------------------------------------------------------- real vLLM
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run in a new process group, output merged; on timeout the group and every descendant (vLLM's engine
    processes) are killed and TimeoutError names the command (tests/procs.py)."""
    rc, out = finish(start(cmd, cwd=ROOT, env=ENV), timeout)
    return subprocess.CompletedProcess(cmd, rc, out)


@pytest.mark.vllm
def test_vllm_regeneration_killed_after_a_chunk_resumes_to_the_uninterrupted_file(tmp_path):
    pytest.importorskip("vllm")
    prompts = tmp_path / "p.jsonl"
    n = 8
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i + 3}? Explain."}) + "\n"
                               for i in range(n)))
    flags = ["-m", "data.regenerate", f"--regenerate.prompts={prompts}", "--regenerate.num_prompts=null",
             "--regenerate.batch_size=2", "--regenerate.max_new_tokens=48", "--regenerate.engine=vllm"]
    killed = tmp_path / "killed" / "regenerated.jsonl"
    # SIGKILLed (with vLLM's engine processes) from inside, right after the first chunk's fsync: a poll from here
    # was starved by vLLM's spinning CPU workers (tests/crash_at.py says why nice did not help)
    proc = kill_when([sys.executable, str(ROOT / "tests" / "crash_at.py"), killed.name, "1", *flags, "--out",
                      str(killed.parent)], lambda: False, timeout=600, cwd=ROOT, env=ENV)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert killed.read_bytes().count(b"\n") == 2  # the first chunk, nothing after it
    resumed, whole = [_run([sys.executable, *flags, "--out", str(out)], timeout=600)
                      for out in (killed.parent, tmp_path / "whole")]
    for r in (resumed, whole):
        assert r.returncode == 0, r.stdout[-3000:]
    assert f"({n - 2} generated now, 2 from an earlier run)" in resumed.stdout
    text = killed.read_text()
    assert text == (tmp_path / "whole" / "regenerated.jsonl").read_text()
    ids = [json.loads(line)["id"] for line in text.splitlines()]
    assert len(ids) == len(set(ids)) == n


@pytest.mark.vllm
@pytest.mark.timeout(1500)  # three vLLM engines (about 1-2 minutes each on 2 loaded cores) after the eval
def test_eval_engine_vllm_writes_the_served_section(tmp_path):
    pytest.importorskip("vllm")
    import torch

    from data.config import TargetConfig
    from data.target import load_target
    from heads import registry
    from heads.base import save_head
    from heads.eagle import Eagle3Config

    _, _, io = load_target(TargetConfig(name_or_path="smollm2-135m", device="cpu"))
    torch.manual_seed(0)
    cfg = Eagle3Config(draft_vocab_size=512, ttt_length=1)
    head = save_head(tmp_path / "head", registry.get("eagle3").build(cfg, io), cfg, io)
    r = _run([sys.executable, "-m", "eval.run", "--head", str(head), "--bench", "gsm8k", "--max-questions", "2",
              "--max-new-tokens", "24", "--k", "2", "--temperature", "0,1", "--batch-sizes", "1,2",
              "--sweep-new-tokens", "4", "--baselines", "", "--engine", "vllm", "--out", str(tmp_path / "ev")],
             timeout=1400)
    assert r.returncode == 0, r.stdout[-4000:]
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    served = report["benchmarks"]["gsm8k"]["vllm"]
    greedy, sampled = served["by_temperature"]["0"], served["by_temperature"]["1"]
    assert served["num_speculative_tokens"] == 2 and served["engine"].startswith("vllm ")
    assert greedy["drafts"] > 0 and len(greedy["acceptance_per_position"]) == 2
    assert greedy["tested_per_position"][0] == greedy["drafts"]
    assert greedy["tokens_per_s"] > 0 and greedy["plain_tokens_per_s"] > 0
    assert greedy["agreement"]["compared"] and greedy["agreement"]["agrees"], greedy["agreement"]
    # T = 1 is served with probabilistic drafts and compared; a disagreement is an engine fault, numbers withheld
    assert served["draft_sample_method"] == "probabilistic" and sampled["agreement"]["compared"]
    assert ("engine_fault" in sampled) == (not sampled["agreement"]["agrees"])
    assert ("engine_fault" in sampled) == (sampled["speedup"] is None)
    # the engine's curve at the eval's batch sizes: plain, fixed k, per-batch-size k (0 where the head lost)
    curve = report["vllm_concurrency"]
    assert curve["concurrency"] == [1, 2] and [r["concurrency"] for r in curve["rows"]] == [1, 2]
    assert all(r["plain_tok_s"] > 0 and r["head_tok_s"] > 0 and r["per_batch_tok_s"] > 0 for r in curve["rows"])
    assert [x[2] for x in curve["per_batch_size_schedule"]] == [r["per_batch_k"] for r in curve["rows"]]
    assert curve["per_batch_size_schedule"][0][:2] == [1, 1]
    # an untrained head (tau ~1) drafts nowhere under the schedule, served by its own engine at k 0
    assert (curve["per_batch_size_run"] == "its own engine") == any(r["per_batch_k"] != 2 for r in curve["rows"])
    md = (tmp_path / "ev" / "report.md").read_text()
    assert "## vLLM throughput against concurrency" in md and "## Served by vLLM: gsm8k" in md


# ------------------------------------------------------------------- extraction through vLLM (features.engine)
EXTRACT = [sys.executable, "-m", "data.extract", "--config", "configs/smollm2-135m.yaml",
           "--data.path=data/bundled/tiny_conversations.jsonl", "--data.max_samples=16", "--features.engine=vllm",
           "--features.shard_tokens=600", "--features.batch_tokens=1200", "--features.vllm_check_samples=2"]


def _manifest(store: Path, split: str, name: str = "manifest.json") -> list[tuple[str, str]]:
    m = json.loads((store / split / name).read_text())
    return [(s["file"], s["sha256"]) for s in m["shards"]]


def _same_to_engine_rounding(a: Path, b: Path) -> None:
    """Two shards of vLLM stores hold the same rows: offsets, sample ids and target argmax exactly, the
    features to within vLLM's own run-to-run rounding (mean relative L2 per token; a wrong layer is ~0.25)."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys(), (a, b)
    for key in x:
        if x[key].dtype.is_floating_point:
            d = (x[key].double() - y[key].double()).norm(dim=-1) / y[key].double().norm(dim=-1).clamp_min(1e-12)
            assert x[key].shape == y[key].shape and d.mean().item() < 1e-4, (a.name, key, d.mean().item())
        else:
            assert torch.equal(x[key], y[key]), (a.name, key)


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # three vLLM starts (about 1 minute each on 2 loaded cores)
def test_vllm_extraction_killed_after_a_shard_resumes_to_the_uninterrupted_store(tmp_path):
    """vLLM's capture is not bitwise reproducible from run to run: llm.generate hands requests to the engine
    core process one at a time and it steps as soon as the first arrives, so how a chunk is batched depends on
    timing, and so do a few bf16 ulps (two uninterrupted runs here differed in one shard of five, mean relative
    difference 2.5e-6, argmax identical; CI caught it). So the resumed store must keep the killed run's
    finished shards byte for byte, and hold the uninterrupted store's shards, rows and tokens exactly and its
    features to rounding."""
    pytest.importorskip("vllm")
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    part = killed / "features" / "train" / "part-r0000of0001.json"  # written atomically, a shard at a time
    # SIGKILLed from inside right after the part file's second write (its header, then its first shard): see
    # the regeneration test above
    proc = kill_when([sys.executable, str(ROOT / "tests" / "crash_at.py"), "train/" + part.name, "2", *EXTRACT[1:],
                      "--out", str(killed)], lambda: False, timeout=600, cwd=ROOT, env=ENV)
    assert proc.returncode == -signal.SIGKILL, "the extraction finished before it could be killed"
    assert not (part.parent / "manifest.json").exists()
    assert len(json.loads(part.read_text())["shards"]) == 1
    finished = _manifest(killed / "features", "train", part.name)
    for out in (killed, whole):
        r = _run([*EXTRACT, "--out", str(out)], timeout=600)
        assert r.returncode == 0, r.stdout[-3000:]
    assert finished and set(finished) <= set(_manifest(killed / "features", "train"))  # kept, not redone
    for split in ("train", "holdout"):
        resumed, uninterrupted = _manifest(killed / "features", split), _manifest(whole / "features", split)
        assert [f for f, _ in resumed] == [f for f, _ in uninterrupted]
        for f, _ in resumed:
            _same_to_engine_rounding(killed / "features" / split / f, whole / "features" / split / f)
    assert len(_manifest(whole / "features", "train")) >= 3  # the kill landed before the last shard
    r = _run([sys.executable, "-m", "data.extract", "verify", str(killed / "features")], timeout=300)
    assert r.returncode == 0 and r.stdout.count("OK ") == 2, r.stdout
    # the numerics check ran and its table is in the report: every layer and `last` agree to float32 rounding
    report = json.loads((whole / "features" / "extraction_report.json").read_text())
    rows = {row["layer"]: row for row in report["numerics"]["layers"]}
    assert set(rows) == {"last", "2", "15", "27"} and report["numerics"]["capture_ids"] == [2, 15, 27, 30]
    assert all(row["rel"] < 1e-4 for row in rows.values()), rows
    assert report["numerics"]["argmax_agreement"] > 0.99
    assert "| 15 |" in (whole / "features" / "extraction_report.md").read_text()
    assert not list((whole / "features").glob(".vllm-spool-*"))  # the connector's files are all read back


@pytest.mark.vllm
def test_vllm_extraction_above_the_tolerance_is_one_line_and_exit_2(tmp_path):
    pytest.importorskip("vllm")
    r = _run([*EXTRACT, "--data.max_samples=4", "--features.vllm_check_tolerance=1e-12", "--out", str(tmp_path)],
             timeout=600)
    assert r.returncode == 2, r.stdout[-3000:]
    errors = [line for line in r.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: features.vllm_check_tolerance: vLLM's capture of layer")
    assert "Traceback" not in r.stdout
    assert not list((tmp_path / "features").rglob("shard-*"))  # refused before any shard
    assert "REFUSED" in (tmp_path / "features" / "extraction_report.md").read_text()


PLANTED_INDEX = '''
import sys
from pathlib import Path
from data.config import TargetConfig
from data.target import load_target
from data.vllm_capture import NumericsError, VllmCapture, check_numerics

if __name__ == "__main__":
    model, tok, _ = load_target(TargetConfig(name_or_path="smollm2-135m", device="cpu"))
    rows = [tok(t)["input_ids"] for t in ("The capital of France is Paris, and the capital of Spain is",
                                          "def add(a, b):\\n    return a + b\\n\\nprint(add(2, 3))")]
    # the planted bug: vLLM asked for every layer one too deep, the pre-norm output still right
    cap = VllmCapture(TargetConfig(name_or_path="smollm2-135m"), [2, 15, 27], 30, Path(sys.argv[1]),
                      max_model_len=256, capture_ids=[3, 16, 28, 30])
    try:
        check_numerics(model, cap, rows, 0.02)
    except NumericsError as e:
        print("REFUSED", e)
        sys.exit(3)
    print("PASSED")
'''


@pytest.mark.vllm
def test_the_numerics_check_refuses_a_wrong_layer_index(tmp_path):
    # Adjacent layers differ by ~1e-3 in max-relative terms (SmolLM2's 2.5e4 channels), so this fails if the
    # check measured that; the per-token relative difference is ~0.25.
    pytest.importorskip("vllm")
    script = tmp_path / "planted.py"
    script.write_text(PLANTED_INDEX)
    r = _run([sys.executable, str(script), str(tmp_path / "spool")], timeout=600)
    assert r.returncode == 3 and "REFUSED features.vllm_check_tolerance: vLLM's capture of layer" in r.stdout, \
        r.stdout[-3000:]


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_online_training_through_vllm_follows_the_transformers_stream(tmp_path):
    """features.mode online with features.engine vllm: the training process starts its own engine (numerics
    checked first) and its first steps' losses are the transformers stream's to float32 rounding."""
    pytest.importorskip("vllm")
    train = [sys.executable, "train/eagle.py", "--config", "configs/smollm2-135m.yaml",
             "--data.path=data/bundled/tiny_conversations.jsonl", "--data.max_samples=12", "--data.holdout_fraction=0",
             "--features.mode=online", "--train.max_steps=3", "--train.batch_size=4", "--train.log_every=1",
             "--train.eval_every=1000", "--train.checkpoint_every=1000", "--logging.wandb_mode=disabled",
             "--features.vllm_check_samples=2", "--head.draft_vocab_size=128",
             "--train.mixed_precision=no"]  # float32 steps: the comparison is of the two feature streams
    losses = {}
    for engine in ("transformers", "vllm"):
        r = _run([*train, f"--features.engine={engine}", "--out", str(tmp_path / engine)], timeout=900)
        assert r.returncode == 0, r.stdout[-3000:]
        rows = [json.loads(line) for line in (tmp_path / engine / "metrics.jsonl").read_text().splitlines()]
        losses[engine] = [row["loss"] for row in rows if row.get("event") == "train"]
    assert "vLLM against transformers on 2 sequences" in r.stdout
    assert len(losses["vllm"]) == len(losses["transformers"]) == 3
    assert losses["vllm"] == pytest.approx(losses["transformers"], rel=1e-3), losses
