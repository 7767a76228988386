"""Issue 29: nothing lost, nothing clobbered, nothing claimed that was not measured.

Each test replays one case of the audit and asserts the new behaviour: a one-line refusal (exit 2) and
every file that existed before unchanged, or a clean resume. Subprocesses go through tests/procs.py.

    .venv/bin/python -m pytest -q tests/test_faults.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from procs import run

from data.cli import UserError, cli_main
from data.config import load_config
from data.files import FolderLock, append_line, claim_folder

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file below `folder` (not following symlinks) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def _finished_run(out: Path) -> Path:
    """A folder laid out like a finished training run (what a fresh run must not replace)."""
    (out / "head").mkdir(parents=True)
    (out / "head" / "model.safetensors").write_bytes(b"weights of the finished run")
    (out / "checkpoints" / "step-00000006").mkdir(parents=True)
    (out / "config.yaml").write_text("seed: 0\n")
    (out / "metrics.jsonl").write_text('{"event": "end", "step": 6}\n')
    return out


def _train_cfg(out: Path, tmp_path: Path):
    cfg = load_config("configs/tiny-eagle.yaml", ["--train.max_steps=4", "--train.batch_size=2",
                                                  "--train.log_every=1", "--train.eval_every=100",
                                                  "--train.checkpoint_every=100", "--optim.warmup_steps=1",
                                                  f"--data.cache_dir={tmp_path / 'tok-cache'}"])
    cfg.out = str(out)
    return cfg


# ----------------------------------------------------------------------------------------------- training folders
def test_fresh_training_refuses_a_finished_run_directly_and_through_a_symlink(tmp_path):
    from train.errors import TrainError
    from train.loop import train

    run_dir = _finished_run(tmp_path / "run")
    before = _snapshot(run_dir)
    with pytest.raises(TrainError, match="already holds a training run.*--resume auto"):
        train(_train_cfg(run_dir, tmp_path))
    (tmp_path / "link").symlink_to(run_dir)
    with pytest.raises(UserError, match="symlink"):
        train(_train_cfg(tmp_path / "link", tmp_path))
    assert _snapshot(run_dir) == before


def test_a_symlink_inside_the_run_folder_is_refused_and_its_target_untouched(tmp_path):
    from train.loop import train

    victim = tmp_path / "elsewhere.txt"
    victim.write_text("a file outside the run\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(UserError, match="metrics.jsonl: a symlink inside the run folder"):
        train(_train_cfg(tmp_path / "run", tmp_path), resume="auto")
    assert victim.read_text() == "a file outside the run\n"
    with pytest.raises(UserError, match="symlink"):
        append_line(tmp_path / "run" / "metrics.jsonl", "{}")
    assert victim.read_text() == "a file outside the run\n"


def test_wandbs_own_links_do_not_block_a_resume_but_our_files_and_the_wandb_folder_are_checked(tmp_path):
    from data.files import refuse_symlinks

    run_dir = tmp_path / "run"
    (run_dir / "wandb" / "offline-run-1").mkdir(parents=True)
    (run_dir / "wandb" / "latest-run").symlink_to("offline-run-1")  # what wandb.init(dir=OUT) leaves behind,
    (run_dir / "wandb" / "offline-run-1" / "debug-core.log").symlink_to(tmp_path / "cache.log")  # and this
    refuse_symlinks(run_dir, "run folder", tools=("wandb",))
    with pytest.raises(UserError, match="latest-run: a symlink inside the run folder"):
        refuse_symlinks(run_dir, "run folder")  # only the tool's own folder is exempt
    # a run folder inside this one (QS_FAMILY=dflash trains into OUT/dflash) has wandb's links too
    (run_dir / "dflash" / "wandb" / "offline-run-2").mkdir(parents=True)
    (run_dir / "dflash" / "wandb" / "latest-run").symlink_to("offline-run-2")
    refuse_symlinks(run_dir, "run folder", tools=("wandb",))
    (run_dir / "dflash" / "metrics.jsonl").symlink_to(tmp_path / "cache.log")
    with pytest.raises(UserError, match="dflash/metrics.jsonl: a symlink inside the run folder"):
        refuse_symlinks(run_dir, "run folder", tools=("wandb",))  # the nested run's own files are checked
    (run_dir / "dflash" / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").symlink_to(run_dir / "wandb" / "latest-run")
    with pytest.raises(UserError, match="metrics.jsonl: a symlink inside the run folder"):
        refuse_symlinks(run_dir, "run folder", tools=("wandb",))  # our own files are still checked
    (run_dir / "metrics.jsonl").unlink()
    shutil.move(run_dir / "wandb", tmp_path / "wandb")
    (run_dir / "wandb").symlink_to(tmp_path / "wandb")
    with pytest.raises(UserError, match="wandb: a symlink inside the run folder"):
        refuse_symlinks(run_dir, "run folder", tools=("wandb",))  # the tool's folder itself must be real


def test_a_second_training_on_one_folder_is_refused_and_a_dead_holders_lock_is_taken(tmp_path):
    from train.loop import train

    out = tmp_path / "run"
    with FolderLock(out, "a training"):  # a live process (this one) trains there
        with pytest.raises(UserError, match=f"already running here \\(process {os.getpid()}"):
            train(_train_cfg(out, tmp_path), resume="auto")
    assert not out.exists()  # the refused run left nothing, not even the folder its lock created
    out.mkdir()
    dead = run([sys.executable, "-c", "import os; print(os.getpid())"], timeout=60)
    (out / ".lock").write_text(f"{int(dead.stdout)} {socket.gethostname()}\n")  # a SIGKILLed run's lock
    with FolderLock(out, "a training") as lock:
        assert lock.owned and (out / ".lock").read_text().split()[0] == str(os.getpid())
    assert not (out / ".lock").exists()


def test_ctrl_c_saves_a_checkpoint_and_a_resume_finishes(tmp_path, capsys):
    from train.loop import train

    cfg = _train_cfg(tmp_path / "run", tmp_path)

    def ctrl_c(step: int) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = train(cfg, on_step=ctrl_c)
    assert stopped["stopped"] and (tmp_path / "run" / "checkpoints" / "step-00000002" / "progress.json").is_file()
    assert "stopped by signal; state saved to" in capsys.readouterr().out
    assert train(cfg, resume="auto")["step"] == 4
    assert not (tmp_path / "run" / ".lock").exists()


def test_keyboard_interrupt_at_the_cli_is_one_line(capsys):
    @cli_main
    def main() -> None:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 130 and err == "error: interrupted (Ctrl-C)\n"


# ----------------------------------------------------------------------------------------------- eval folders
def test_eval_out_at_a_training_run_is_refused_before_any_work(tmp_path, capsys):
    from eval.run import main

    run_dir = _finished_run(tmp_path / "run")
    before = _snapshot(run_dir)
    with pytest.raises(SystemExit) as e:
        main(["--drafter", "ngram", "--target", "tiny-random-llama", "--bench", "gsm8k", "--out", str(run_dir)])
    assert e.value.code == 2 and "did not write" in capsys.readouterr().err
    assert _snapshot(run_dir) == before
    with pytest.raises(UserError, match="owned by stage .eval."):
        claim_folder(tmp_path / "ev", "eval", ())  # an eval folder: export or training may not take it
        claim_folder(tmp_path / "ev", "export", ())


def _report(tau: float, max_new: int) -> dict:
    bench = {"by_temperature": {"0.0": {"tau": tau, "speedup": 1.2, "acceptance_per_position": [0.5],
                                        "plain": {"tokens_per_s": 10.0}, "categories": {}, "baselines": {}}}}
    return {"target": "t", "drafter": "ngram", "k": 2, "k_source": "fixed", "tree": "chain", "policy": "fixed",
            "tau_definition": "tau", "speedup_definition": "s", "max_new_tokens": max_new,
            "benchmarks": {"b": bench}, "machine": {"device": "cpu"}}


def test_a_killed_report_write_leaves_no_mixed_report(tmp_path, monkeypatch):
    import eval.report as rep

    monkeypatch.setattr(rep, "markdown", lambda r: f"max {r['max_new_tokens']} new tokens\n")
    monkeypatch.setattr(rep, "PLOTS", ())
    rep.write_report(_report(2.0, 16), tmp_path / "ev", config_yaml="seed: 0\n")
    assert rep.load_report(tmp_path / "ev")["max_new_tokens"] == 16

    def killed(path, data):  # the process dies right after report.md is in place
        if Path(path).name == "report.json":
            raise KeyboardInterrupt
        return real(path, data)

    real = rep.write_atomic
    monkeypatch.setattr(rep, "write_atomic", killed)
    with pytest.raises(KeyboardInterrupt):
        rep.write_report(_report(3.0, 64), tmp_path / "ev", config_yaml="seed: 1\n")
    with pytest.raises(UserError, match="no eval finished"):
        rep.load_report(tmp_path / "ev")  # none, never the old report.json beside the new report.md
    monkeypatch.setattr(rep, "write_atomic", real)
    rep.write_report(_report(3.0, 64), tmp_path / "ev", config_yaml="seed: 1\n")
    (tmp_path / "ev" / "report.md").write_text("max 16 new tokens\n")  # the pair disagrees: refused
    with pytest.raises(UserError, match="report.md: does not match"):
        rep.load_report(tmp_path / "ev")


# ----------------------------------------------------------------------------------------------- publish
from test_publish import _publish  # noqa: E402  (scripts/publish.py loaded as a module, one loader)


@pytest.fixture()
def head_dir(tiny_target, tmp_path):
    from heads import eagle
    from heads.base import save_head

    torch.manual_seed(0)
    cfg = eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=64)
    return save_head(tmp_path / "run" / "head", eagle.build(cfg, tiny_target[2]), cfg, tiny_target[2])


def test_publish_refuses_a_report_of_another_head(head_dir, tmp_path, capsys):
    ev = tmp_path / "run" / "eval"
    ev.mkdir()
    (ev / "report.json").write_text(json.dumps({"head_sha256": "0" * 64, "benchmarks": {
        "b": {"by_temperature": {"0.0": {"tau": 9.99, "speedup": 5.0}}}}}))
    assert _publish().main(["--head", str(head_dir), "--repo-id", "me/x", "--dry-run"]) == 2
    out = capsys.readouterr()
    assert "measured another head" in out.err and "9.99" not in out.out


def test_publish_refuses_a_repo_id_the_hub_would_refuse(head_dir, capsys):
    with pytest.raises(SystemExit) as e:
        _publish().main(["--head", str(head_dir), "--repo-id", "me/x `rm -rf ~`", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--repo-id" in err and "Traceback" not in err


def test_publish_keeps_the_traceback_of_a_bug(head_dir, monkeypatch):
    mod = _publish()
    monkeypatch.setattr(mod, "find_report", lambda *a: (_ for _ in ()).throw(KeyError("bug")))
    with pytest.raises(KeyError):
        mod.main(["--head", str(head_dir), "--repo-id", "me/x", "--dry-run"])


# ----------------------------------------------------------------------------------------------- exports
KILL_DURING_COMMIT = """
import os, signal, sys
import convert.folders as f
from convert import export_head
from data.config import TargetConfig
from data.target import load_target
_, _, io = load_target(TargetConfig(name_or_path="tiny-random-llama", device="cpu"))
real = f.validate_folder
def killed(folder, fmt, target=None):
    real(folder, fmt, target)
    os.kill(os.getpid(), signal.SIGKILL)  # the new export is complete beside the old one: die before the swap
f.validate_folder = killed
export_head(sys.argv[1], sys.argv[2], sys.argv[3], io, force=True)
"""


@pytest.mark.parametrize("fmt", ["speculators", "native"])
def test_sigkill_during_export_force_keeps_the_old_export_and_a_rerun_replaces_it(head_dir, tiny_target, tmp_path, fmt):
    from convert import export_head

    out = export_head(head_dir, fmt, tmp_path / "exp", tiny_target[2])
    before = _snapshot(out)
    res = run([sys.executable, "-c", KILL_DURING_COMMIT, str(head_dir), fmt, str(out)], cwd=ROOT, timeout=120,
              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == -signal.SIGKILL, res.stdout + res.stderr
    assert _snapshot(out) == before  # the previous complete export, untouched
    assert export_head(head_dir, fmt, out, tiny_target[2], force=True) == out  # the rerun replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "run"]  # the killed run's temporary folder is gone


def test_export_to_a_symlinked_out_is_refused_and_leaves_nothing(head_dir, tiny_target, tmp_path):
    from convert import ExportError, export_head

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for fmt in ("speculators", "native"):
        with pytest.raises(ExportError, match="link: is a symlink"):
            export_head(head_dir, fmt, tmp_path / "link", tiny_target[2], force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "run"]


# ----------------------------------------------------------------------------------------------- head folders
def _tampered_head(head_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of head_dir whose weights (and recorded sha256) went through `edit(state, meta)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    from heads.base import sha256_file

    out = tmp_path / "tampered"
    shutil.copytree(head_dir, out)
    state, meta = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    edit(state, meta)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if "files" in meta:
        meta["files"] = {"model.safetensors": sha256_file(out / "model.safetensors")}
    (out / "config.json").write_text(json.dumps(meta))
    return out


@pytest.mark.parametrize("bad", ["d2t_out_of_range", "d2t_negative", "t2d_disagrees"])
def test_a_head_whose_vocab_map_leaves_the_vocabulary_is_refused(head_dir, tiny_target, tmp_path, bad):
    from convert import export_head
    from heads.base import HeadError, load_head

    def edit(state, meta):
        if bad == "d2t_out_of_range":
            state["d2t"][-1] = 10_000
        elif bad == "d2t_negative":
            state["d2t"][3] = -2
        else:
            state["t2d"][:] = False

    head = _tampered_head(head_dir, tmp_path, edit)
    with pytest.raises(HeadError, match="d2t|t2d"):
        load_head(head, tiny_target[2])
    with pytest.raises(HeadError, match="d2t|t2d"):
        export_head(head, "speculators", tmp_path / "exp", tiny_target[2])
    assert not (tmp_path / "exp").exists()


def test_a_head_without_its_checksum_is_refused_not_recertified(head_dir, tiny_target, tmp_path):
    from convert import export_head
    from heads.base import HeadError

    def flip(state, meta):
        state["lm_head.weight"].neg_()  # flipped weights
        meta.pop("files")

    head = _tampered_head(head_dir, tmp_path, flip)
    with pytest.raises(HeadError, match="'files'"):
        export_head(head, "native", tmp_path / "exp", tiny_target[2])
    assert not (tmp_path / "exp").exists()


# ----------------------------------------------------------------------------------------------- config files
@pytest.mark.parametrize("doc,needle", [
    # billion laughs: 9^5 list items from a few lines (the loader used to hang expanding them)
    ("a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ntrain: [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n", "line 2: YAML aliases (*a)"),
    ("train: &t [*t]\n", "YAML aliases (*t)"),  # recursive: a RecursionError traceback before
    ("train: " + "[" * 3000 + "]" * 3000 + "\n", "nested more than"),
])
def test_config_aliases_and_deep_nesting_are_one_line(tmp_path, doc, needle):
    from data.config import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text(doc)
    with pytest.raises(ConfigError, match=re.escape(needle)) as e:
        load_config(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------- command lines
@pytest.mark.parametrize("flag,value", [("--max-new-tokens", "0"), ("--bench", ","), ("--temperature", "nan"),
                                        ("--temperature", "-1"), ("--batch-sizes", "0"), ("--batch-sizes", ""),
                                        ("--threads", "-1"), ("--k", "0"), ("--max-questions", "-2")])
def test_eval_ranges_are_checked_at_parse_time(tmp_path, capsys, flag, value):
    from eval.run import main

    with pytest.raises(SystemExit) as e:
        main(["--drafter", "ngram", "--target", "tiny-random-llama", "--out", str(tmp_path / "ev"), f"{flag}={value}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {flag}: expected") and err.count("\n") == 1, err
    assert not (tmp_path / "ev").exists()


# ----------------------------------------------------------------------------------------------- regeneration
def _regen_cfg(out: Path, prompts: Path):
    from data.config import RunConfig, TargetConfig

    cfg = RunConfig()
    cfg.target = TargetConfig(name_or_path="tiny-random-llama", device="cpu")
    cfg.out = str(out)
    cfg.regenerate.prompts = str(prompts)
    cfg.regenerate.num_prompts = None
    cfg.regenerate.max_new_tokens = 4
    cfg.regenerate.batch_size = 2
    return cfg


def test_regenerate_refuses_an_existing_user_file_unchanged(tiny_target, tmp_path):
    import data.regenerate as rg

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "prompt": "hello"}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "regenerated.jsonl").write_text('{"my": "notes"}\n{"not closed"')  # no newline at the end
    (out / "config.yaml").write_text("mine: 1\n")
    before = _snapshot(out)
    with pytest.raises(UserError, match="regenerated.jsonl exists but regenerated.meta.json does not"):
        rg.regenerate(_regen_cfg(out, prompts), tiny_target[0], tiny_target[1])
    assert _snapshot(out) == before


def test_duplicate_ids_stay_unique_uninterrupted_and_resumed(tiny_target, tmp_path, monkeypatch):
    import data.regenerate as rg

    rows = [{"id": i, "prompt": f"question {n}"} for n, i in enumerate(["a", "a", "a#2", "b", "a"])]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def ids(path: Path) -> list[str]:
        return [json.loads(line)["id"] for line in path.read_text().splitlines()]

    whole = Path(rg.regenerate(_regen_cfg(tmp_path / "whole", prompts), *tiny_target[:2])["output"])
    assert ids(whole) == ["a", "a#2", "a#2#2", "b", "a#3"]
    real, calls = rg.generate_batch, []

    def killed_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(rg, "generate_batch", killed_on_second)
    cfg = _regen_cfg(tmp_path / "cut", prompts)
    with pytest.raises(KeyboardInterrupt):
        rg.regenerate(cfg, *tiny_target[:2])
    monkeypatch.setattr(rg, "generate_batch", real)
    resumed = Path(rg.regenerate(cfg, *tiny_target[:2])["output"])
    assert resumed.read_text() == whole.read_text()


# ----------------------------------------------------------------------------------------------- tokenized cache
@pytest.mark.parametrize("alter", ["shifted", "out_of_vocab"])
def test_altered_tokenized_cache_is_refused(tiny_target, tmp_path, alter):
    import shutil

    import datasets

    from data.readers import DataError
    from data.tokenize import build_datasets

    cfg = load_config("configs/tiny-eagle.yaml", [f"--data.cache_dir={tmp_path / 'cache'}", "--data.max_samples=8"])
    cfg.out = str(tmp_path / "run")
    tok = tiny_target[1]
    want = list(build_datasets(cfg, tok)[0][0]["input_ids"])  # read now: the datasets map the cache file
    (cache,) = (tmp_path / "cache").glob("tokenized-*.arrow")
    delta = 1 if alter == "shifted" else 10_000
    ds = datasets.Dataset.from_file(str(cache))
    ds.map(lambda r: {"input_ids": [(t + delta) % len(tok) if delta == 1 else t + delta for t in r["input_ids"]]},
           cache_file_name=str(tmp_path / "altered.arrow"))
    shutil.copyfile(tmp_path / "altered.arrow", cache)
    with pytest.raises(DataError, match="does not match its checksum"):
        build_datasets(cfg, tok)
    cache.unlink()  # the one-line advice: delete it, and the same tokens come back
    again = build_datasets(cfg, tok)
    assert list(again[0][0]["input_ids"]) == want


def test_out_of_vocabulary_tokens_are_one_line(tiny_target):
    import datasets

    from data.readers import DataError
    from data.tokenize import check_token_range

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 10_000]]})
    with pytest.raises(DataError, match=r"outside the tokenizer's vocabulary \[0, 259\)"):
        check_token_range(ds, 259, "cache.arrow")


# ----------------------------------------------------------------------------------------------- store locks
def test_a_second_extraction_of_one_shard_set_is_refused(tiny_target, tmp_path):
    from data.extract import extract_split, make_header, target_info
    from data.tokenize import tokenize_records

    model, tok, _ = tiny_target
    ds = tokenize_records([{"id": "c", "messages": [{"role": "user", "content": "x" * 9},
                                                    {"role": "assistant", "content": "y" * 5}]}], tok, 64)
    header = make_header(target_info(model, "tiny-random-llama", None), [1], "float32", "train", ds, 1, 512, 512)
    split = tmp_path / "features" / "train"
    with FolderLock(split, "an extraction", name=".lock-r0000of0001"):  # another extraction of rank 0 of 1
        with pytest.raises(UserError, match="already running here"):
            extract_split(model, ds, split, header, show_progress=False)
        assert not list(split.glob("shard-*")) and not list(split.glob("part-*"))
    assert extract_split(model, ds, split, header, show_progress=False)["complete"]
    assert not list(split.glob(".lock*"))


# ----------------------------------------------------------------------------------------------- test gaps
# Planted bugs that passed every test before (scripts/check_mutants.py names the mutant each test catches).
def test_every_mutant_still_applies():
    """Each of scripts/check_mutants.py's planted bugs replaces a snippet that occurs exactly once in its file: a
    refactor that moves a snippet must move its mutant too (the mutation run, CI's --quick included, would
    otherwise report an error for a bug it no longer plants; this checks them all in the default suite)."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("check_mutants", root / "scripts" / "check_mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    stale = [m.name for m in mod.MUTANTS if mod.snippet_count(m) != 1]
    assert not stale, f"mutants whose snippet no longer occurs exactly once: {stale}"


def test_max_new_tokens_budget_no_pass_drafts_past_the_end(tiny_target):
    """Mutant spec_pass_drafts_past_max_new_tokens: every pass adds its accepted tokens plus one, so with an
    always-right drafter 1 (prefill) + accepted + passes is exactly max_new_tokens; a pass that drafted past
    the end would have its surplus cut off after it was counted (and computed)."""
    from test_decoder import OracleDrafter

    from eval.decoder import plain_generate, speculative_generate

    model, tok, _ = tiny_target
    prompt = tok("def add(a, b): return a + b", return_tensors="pt").input_ids
    ref, _ = plain_generate(model, prompt, 24)
    for m in (2, 5, 9, 24):
        out, st = speculative_generate(model, prompt, OracleDrafter(ref, right=True), 6, m)
        assert out.tolist() == ref[:m].tolist()
        assert 1 + st.accepted_tokens + st.target_passes == st.new_tokens == m, (m, st.accepted_tokens)


def test_credit_goes_to_the_proposer_of_each_accepted_node(tiny_target):
    """Mutants accepted_credit_by_path_position / policy_credit_by_path_position: an accepted node's proposer
    is its own tag (tree.sources[node]), not the tag at its position along the path."""
    from test_decoder import _Tracker

    from eval.costs import DraftCost, VerifyCost
    from eval.decoder import plain_generate, speculative_generate
    from eval.policy import AdaptivePolicy
    from heads.base import DraftTree

    model, tok, _ = tiny_target
    prompt = tok("def add(a, b): return a + b", return_tensors="pt").input_ids
    ref, _ = plain_generate(model, prompt, 4)

    class Branches(_Tracker):  # a wrong head node first, then the right two-token n-gram branch
        def draft(self, k, temperature):
            right = [self.truth(1), self.truth(2)]
            self.tree = DraftTree(torch.tensor([(right[0] + 1) % 259, *right]), torch.tensor([-1, -1, 1]),
                                  sources=["head", "ngram", "ngram"])
            return self.tree

    _, st = speculative_generate(model, prompt, Branches(ref), 3, 4)
    assert st.accepted_by_source == {"ngram": 2}
    sources = ("head", "ngram")
    pol = AdaptivePolicy(VerifyCost({1: 0.05, 4: 0.1}, context_len=8), {s: DraftCost(0.002, 0.001) for s in sources},
                         {s: [0.5] * 4 for s in sources}, prior_weight=1.0, decay=1.0)
    before = {s: list(pol.accepted[s]) for s in sources}
    pol.observe(DraftTree(torch.tensor([9, 1, 2]), torch.tensor([-1, -1, 1]), sources=["head", "ngram", "ngram"]),
                [1, 2])
    assert pol.accepted["ngram"][:2] == [before["ngram"][0] + 1, before["ngram"][1] + 1]
    assert pol.accepted["head"][0] == before["head"][0]  # judged at depth 1 and rejected: no credit


def test_hybrid_budgets_go_to_their_own_proposer():
    """Mutant hybrid_budgets_to_the_wrong_proposer: budgets {"head": 1, "ngram": 4} cap the head's chain at
    one token and the n-gram's at four (swapped, the head would propose three and the n-gram one)."""
    from eval.drafters import HybridDrafter, NgramDrafter
    from heads.base import DraftTree

    class Chain:
        capture_layers = None

        def draft(self, k, temperature):
            return DraftTree.chain(torch.tensor([2, 7, 3][:k]))

    ngram = NgramDrafter()
    ngram.begin(torch.tensor([[5, 1, 2, 7, 8, 9, 5]]), None, 1)  # suffix (5, 1) was continued with 2 7 8 9
    d = HybridDrafter(Chain(), ngram)
    tree = d.draft(4, 0.0, budgets={"head": 1, "ngram": 4})
    assert tree.tokens.tolist() == [2, 7, 8, 9] and tree.sources == ["head+ngram", "ngram", "ngram", "ngram"]


def test_ttt_weighting_step_s_counts_decay_to_the_s(tiny_target):
    """Mutant ttt_steps_weighted_in_reverse: the EAGLE-3 loss is sum_s ttt_decay**s * loss/s."""
    from test_eagle import _batch, _eagle3

    from heads import eagle

    model, _, io = tiny_target
    _, head = _eagle3(io, ttt_decay=0.5)
    torch.manual_seed(1)
    loss, m = eagle.loss(head, _batch(model, head, torch.randint(0, io.vocab_size, (2, 12))), io)
    want = sum(0.5**s * m[f"loss/{s}"] for s in range(3))
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5) and m["loss/0"] != pytest.approx(m["loss/2"])


@pytest.mark.parametrize("t,k,p,mp", [(0.7, 5, 0.9, 0.0), (1.5, 0, 0.8, 0.0), (0.6, 20, 1.0, 0.1),
                                      (1.8, 8, 0.7, 0.2)])
def test_warper_order_is_model_generates(tiny_target, t, k, p, mp):
    """Mutant temperature_after_top_p: target_distribution applies the warpers model.generate builds, in its
    order (taken from transformers itself, not restated by hand)."""
    from transformers import GenerationConfig, LogitsProcessorList

    from data.sampling import target_distribution

    model = tiny_target[0]
    gc = GenerationConfig(do_sample=True, temperature=t, top_k=k, top_p=p, min_p=mp or None)
    procs = model._get_logits_processor(gc, input_ids_seq_length=1, logits_processor=LogitsProcessorList(),
                                        device="cpu")
    torch.manual_seed(0)
    logits = torch.randn(3, 259) * 4
    want = torch.softmax(procs(torch.zeros(3, 1, dtype=torch.long), logits.clone()), -1)
    torch.testing.assert_close(target_distribution(logits, t, k, p, mp), want)


def test_per_row_positions_the_shortest_row_first(tiny_target):
    """Mutant batch_rows_take_row_0s_positions: each row counts its own real tokens. With the most padded row
    first, borrowing row 0's positions would put several real tokens of the others at position 0 (a row
    whose positions are merely shifted by a constant looks the same under RoPE, so order matters here)."""
    from transformers import LlamaForCausalLM

    from data.target import tiny_config
    from eval.batch import batched_generate

    tok = tiny_target[1]
    torch.manual_seed(1)  # test_decoder's varied tiny Llama (init 0.3): its greedy tokens depend on position
    cfg = tiny_config("tiny-random-llama", len(tok))
    cfg.initializer_range = 0.3
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    texts = ["2+2=", "Tell me a long story about a cat and a dog.", "Write a haiku."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True,
                                       return_dict=False) for t in texts]
    both = batched_generate(model, prompts, 10, tok.pad_token_id)
    for i, p in enumerate(prompts):
        assert torch.equal(both.tokens[i], batched_generate(model, [p], 10, tok.pad_token_id).tokens[0]), i
