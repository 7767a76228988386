"""Careless and hostile inputs at every entry point (issue 13's table): each user error is ONE `error:` line
on stderr naming the place, exit code 2 (the store verifier's documented code for a damaged store is 1),
and no input or output file is changed or deleted. Then the rows that are not errors: a resume applies a
changed lr and records it, a corrupt newest checkpoint falls back to the previous one, a finished run
resumes to nothing, and a pickle payload in a checkpoint never runs.

The entry points run in-process (their `main`, wrapped by data.cli.cli_main exactly as on the command
line), on the tiny random Llama; one short training run is shared and copied where a case changes it.

    .venv/bin/python -m pytest -q tests/test_bad_inputs.py
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import importlib.util
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import data.extract
import data.tokenize
import eval.run
import train.checkpoint
import train.loop
from data.config import load_config
from data.extract import run as extract_run
from heads.base import sha256_file
from train.schedule import lr_factor

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny-eagle.yaml")
STEPS = 4
RUN_FLAGS = [f"--train.max_steps={STEPS}", "--train.batch_size=2", "--train.checkpoint_every=2",
             "--train.eval_every=1000", "--train.log_every=1", "--data.max_samples=24", "--optim.warmup_steps=2",
             "--head.draft_vocab_size=32"]


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train_main(argv: list[str]) -> Any:
    return train.loop.main(argv, family=("eagle1", "eagle3"))


def call(fn: Callable[[list[str]], Any], argv: list[str]) -> int:
    """The exit code an entry point gives for argv (SystemExit code, an int it returns, else 0)."""
    try:
        rc = fn(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return rc if isinstance(rc, int) else 0


def snapshot(*folders: Path) -> dict[str, str]:
    """path -> sha256 of every file under the folders (and the folders' own listing)."""
    out: dict[str, str] = {}
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def rows(out: Path) -> list[dict]:
    def no_nan(s: str) -> None:
        raise AssertionError(f"metrics.jsonl holds {s}: not strict JSON")

    return [json.loads(line, parse_constant=no_nan) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tok-cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """A finished 4-step tiny EAGLE-3 run with checkpoints at steps 2 and 4 and OUT/head."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert call(train_main, ["--config", TINY, "--out", str(out), f"--data.cache_dir={cache}", *RUN_FLAGS]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    return out


@pytest.fixture()
def run_copy(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _target_folder(folder: Path, seed: int) -> Path:
    """The tiny Llama saved as a local target folder, weights drawn with `seed` (same shapes for any seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from data.target import byte_tokenizer, tiny_config

    tok = byte_tokenizer()
    config = tiny_config("tiny-random-llama", len(tok))
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> dict[str, Any]:
    """A local target folder A and a run folder with a store extracted from it (both splits)."""
    tmp = tmp_path_factory.mktemp("store")
    target = _target_folder(tmp / "A", seed=1)
    flags = [f"--target.name_or_path={target}", "--features.mode=offline", "--features.dtype=float32",
             f"--data.cache_dir={cache}", "--data.max_samples=24", "--features.shard_tokens=2000"]
    cfg = load_config(TINY, flags)
    cfg.out = str(tmp / "run")
    extract_run(cfg)
    return {"target": target, "out": tmp / "run", "flags": flags}


# ----------------------------------------------------------------------------------------------- the table
@dataclass
class Case:
    entry: Callable[[list[str]], Any]
    argv: list[str]
    needles: tuple[str, ...]  # the one error line must contain each
    watched: list[Path] = field(default_factory=list)  # folders no byte of which may change
    code: int = 2


def _damage(path: Path, offset_from_end: int = 80, n: int = 64) -> None:
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end:-offset_from_end + n] = b"\xff" * n
    path.write_bytes(bytes(raw))


def case_store_of_other_weights(tmp: Path, run: Path, store: dict) -> Case:
    """Row 1: extract from folder A, put other weights (same name, same shapes) in A, train offline."""
    target = _target_folder(tmp / "A", seed=1)
    flags = [f"--target.name_or_path={target}", *store["flags"][1:]]
    cfg = load_config(TINY, flags)
    cfg.out = str(tmp / "r1")
    extract_run(cfg)
    _target_folder(target, seed=2)
    return Case(train_main, ["--config", TINY, "--out", str(tmp / "r1"), *flags, *RUN_FLAGS],
                (str(tmp / "r1" / "features" / "train"), "fingerprint"), [tmp / "r1" / "features"])


def case_resume_with_other_weights(tmp: Path, run: Path, store: dict) -> Case:
    """Row 1, online: a run trained on folder A cannot resume after A holds other weights."""
    target = _target_folder(tmp / "A", seed=1)
    argv = ["--config", TINY, "--out", str(tmp / "r"), f"--target.name_or_path={target}", *RUN_FLAGS]
    assert call(train_main, [*argv, "--train.max_steps=2"]) == 0
    _target_folder(target, seed=2)
    return Case(train_main, [*argv, "--resume", "auto"], ("step-00000002", "fingerprint"), [tmp / "r"])


def case_pickle_in_checkpoint(tmp: Path, run: Path, store: dict) -> Case:
    """Row 2: a pickle file in the newest checkpoint is refused (the payload test below checks it never runs)."""
    torch.save({"a": 1}, run / "checkpoints" / "step-00000004" / "custom_checkpoint_0.pkl")
    return Case(train_main, ["--config", TINY, "--out", str(run), "--resume", "auto", *RUN_FLAGS,
                             "--train.max_steps=6"],
                ("step-00000004", "custom_checkpoint_0.pkl", "--trust-checkpoint"), [run])


def case_manifest_path_outside(tmp: Path, run: Path, store: dict) -> Case:
    """Row 3: a manifest naming a shard outside the store folder is refused, never hashed."""
    copy = tmp / "store"
    shutil.copytree(store["out"] / "features", copy)
    (tmp / "outside").mkdir()
    (tmp / "outside" / "x.safetensors").write_bytes(b"secret")
    m = json.loads((copy / "train" / "manifest.json").read_text())
    m["shards"][0]["file"] = "../../outside/x.safetensors"
    (copy / "train" / "manifest.json").write_text(json.dumps(m))
    return Case(data.extract.main, ["verify", str(copy)], (str(copy / "train" / "manifest.json"),
                                                           "../../outside/x.safetensors"), [copy, tmp / "outside"], 1)


def case_store_split_missing(tmp: Path, run: Path, store: dict) -> Case:
    """Row 4: a store whose train split was deleted does not verify."""
    copy = tmp / "store"
    shutil.copytree(store["out"] / "features", copy)
    shutil.rmtree(copy / "train")
    return Case(data.extract.main, ["verify", str(copy)], (f"BAD {copy / 'train'}: missing",), [copy], 1)


def _nan_head(tmp: Path, run: Path) -> Path:
    head = tmp / "head"
    shutil.copytree(run / "head", head)
    _damage(head / "model.safetensors")
    return head


def case_nan_head_eval(tmp: Path, run: Path, store: dict) -> Case:
    """Row 5 (eval): 0xFF bytes near the end of a head's weights (NaN values)."""
    head = _nan_head(tmp, run)
    return Case(eval.run.main, ["--head", str(head), "--target", "tiny-random-llama", "--out", str(tmp / "ev")],
                (str(head / "model.safetensors"),), [head])


def case_nan_head_export(tmp: Path, run: Path, store: dict) -> Case:
    """Row 5 (export)."""
    head = _nan_head(tmp, run)
    return Case(_script("export").main, ["--head", str(head), "--to", "sglang", "--out", str(tmp / "sgl")],
                (str(head / "model.safetensors"),), [head])


def case_export_force_over_run(tmp: Path, run: Path, store: dict) -> Case:
    """Row 6: --force onto the run folder that holds the head."""
    return Case(_script("export").main, ["--head", str(run / "head"), "--to", "speculators", "--out", str(run),
                                         "--force"], (str(run), "--out"), [run])


def case_export_force_inside_run(tmp: Path, run: Path, store: dict) -> Case:
    """Row 6, variant: --force onto a folder inside a run folder (its checkpoints)."""
    out = run / "checkpoints"
    return Case(_script("export").main, ["--head", str(run / "head"), "--to", "speculators", "--out", str(out),
                                         "--force"], (str(out), "run folder"), [run])


def case_resume_changes_seed(tmp: Path, run: Path, store: dict) -> Case:
    """Row 7, the refused half: a resume cannot change what defines the data order."""
    return Case(train_main, ["--config", TINY, "--out", str(run), "--resume", "auto", *RUN_FLAGS, "--seed=5"],
                ("step-00000004", "seed"), [run])


def _cfg_file(tmp: Path, text: str) -> Path:
    (tmp / "c.yaml").write_text(text)
    return tmp / "c.yaml"


def _train_flag(flag: str, *needles: str) -> Callable[[Path, Path, dict], Case]:
    def build(tmp: Path, run: Path, store: dict) -> Case:
        return Case(train_main, ["--config", TINY, "--out", str(tmp / "o"), flag], needles, [tmp])
    return build


def case_empty_config(tmp: Path, run: Path, store: dict) -> Case:
    cfg = _cfg_file(tmp, "")
    return Case(train_main, ["--config", str(cfg), "--out", str(tmp / "o")], (str(cfg), "empty"), [tmp])


def case_layer_id_99_extract(tmp: Path, run: Path, store: dict) -> Case:
    return Case(data.extract.main, ["--config", TINY, "--out", str(tmp / "o"), "--head.layer_ids=[1,2,99]"],
                ("head.layer_ids", "99"), [tmp])


def case_non_utf8_jsonl(tmp: Path, run: Path, store: dict) -> Case:
    bad = tmp / "in" / "bad.jsonl"
    bad.parent.mkdir()
    bad.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9 \xff"}\n')
    return Case(data.tokenize.main, ["--config", TINY, "--out", str(tmp / "o"), f"--data.path={bad}"],
                (f"{bad}:2", "UTF-8"), [bad.parent])


def case_truncated_gz(tmp: Path, run: Path, store: dict) -> Case:
    lines = "".join(json.dumps({"prompt": f"question {i} " * 20}) + "\n" for i in range(200)).encode()
    bad = tmp / "in" / "bad.jsonl.gz"
    bad.parent.mkdir()
    bad.write_bytes(gzip.compress(lines)[:-400])
    return Case(data.tokenize.main, ["--config", TINY, "--out", str(tmp / "o"), f"--data.path={bad}"],
                (str(bad), "gzip"), [bad.parent])


def case_truncated_head(tmp: Path, run: Path, store: dict) -> Case:
    head = tmp / "head"
    shutil.copytree(run / "head", head)
    w = head / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    return Case(eval.run.main, ["--head", str(head), "--target", "tiny-random-llama", "--out", str(tmp / "ev")],
                (str(w),), [head])


def _head_config_case(edit: Callable[[dict], None]) -> Callable[[Path, Path, dict], Case]:
    def build(tmp: Path, run: Path, store: dict) -> Case:
        head = tmp / "head"
        shutil.copytree(run / "head", head)
        meta = json.loads((head / "config.json").read_text())
        edit(meta)
        (head / "config.json").write_text(json.dumps(meta))
        return Case(eval.run.main, ["--head", str(head), "--target", "tiny-random-llama", "--out", str(tmp / "ev")],
                    (str(head / "config.json"), "'family'"), [head])
    return build


def case_head_wrong_shape(tmp: Path, run: Path, store: dict) -> Case:
    """A head holding a tensor of another shape, its checksum recorded anew (a head without one is refused
    since issue 29): torch's load_state_dict would raise a bare RuntimeError; load_head names the tensor and
    both shapes."""
    from safetensors.torch import load_file, save_file

    from heads.base import sha256_file

    head = tmp / "head"
    shutil.copytree(run / "head", head)
    state = load_file(str(head / "model.safetensors"))
    key = next(k for k, v in sorted(state.items()) if v.ndim == 2)
    state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    save_file(state, str(head / "model.safetensors"))
    meta = json.loads((head / "config.json").read_text())
    meta["files"] = {"model.safetensors": sha256_file(head / "model.safetensors")}
    (head / "config.json").write_text(json.dumps(meta))
    return Case(eval.run.main, ["--head", str(head), "--target", "tiny-random-llama", "--out", str(tmp / "ev")],
                (str(head / "model.safetensors"), key, "has shape"), [head])


def case_resume_nonexistent(tmp: Path, run: Path, store: dict) -> Case:
    return Case(train_main, ["--config", TINY, "--out", str(tmp / "o"), "--resume", str(tmp / "nonexistent")],
                ("--resume", str(tmp / "nonexistent")), [tmp])


def case_disk_full_at_checkpoint(tmp: Path, run: Path, store: dict, monkeypatch: pytest.MonkeyPatch) -> Case:
    """The checkpoint write fails with ENOSPC (simulated): one line naming the file, not a traceback."""
    def full(path: Path, *a: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path / "model.safetensors"))

    monkeypatch.setattr(train.checkpoint, "save_state", full)
    return Case(train_main, ["--config", TINY, "--out", str(tmp / "o"), *RUN_FLAGS],
                ("model.safetensors", "No space left on device"))


def case_publish_stage_holds_user_file(tmp: Path, run: Path, store: dict) -> Case:
    """Row 11: the staging folder D/publish exists with a user's file in it."""
    stage = tmp / "D"
    (stage / "publish").mkdir(parents=True)
    (stage / "publish" / "notes.txt").write_text("mine")
    return Case(_script("publish").main, ["--head", str(run / "head"), "--repo-id", "me/x", "--dry-run", "--force",
                                          "--stage", str(stage)], (str(stage / "publish"), "exists"), [stage])


CASES: dict[str, Callable[..., Case]] = {
    "1-store-of-other-weights": case_store_of_other_weights,
    "1-resume-with-other-weights": case_resume_with_other_weights,
    "2-pickle-in-checkpoint": case_pickle_in_checkpoint,
    "3-manifest-path-outside-store": case_manifest_path_outside,
    "4-store-split-missing": case_store_split_missing,
    "5-nan-head-eval": case_nan_head_eval,
    "5-nan-head-export": case_nan_head_export,
    "6-export-force-over-run": case_export_force_over_run,
    "6-export-force-inside-run": case_export_force_inside_run,
    "7-resume-changes-seed": case_resume_changes_seed,
    "9-negative-lr": _train_flag("--optim.lr=-1", "command line", "'optim.lr'", "greater than 0"),
    "9-layer-id-99-train": _train_flag("--head.layer_ids=[1,2,99]", "head.layer_ids", "99"),
    "9-layer-id-99-extract": case_layer_id_99_extract,
    "9-features-mode-typo": _train_flag("--features.mode=ofline", "command line", "'features.mode'", "ofline"),
    "9-mixed-precision-typo": _train_flag("--train.mixed_precision=bf61", "command line", "'train.mixed_precision'"),
    "9-empty-config": case_empty_config,
    "9-non-utf8-jsonl": case_non_utf8_jsonl,
    "9-truncated-gz": case_truncated_gz,
    "9-truncated-head": case_truncated_head,
    "9-head-config-no-family": _head_config_case(lambda m: m.pop("family")),
    "9-head-config-wrong-family": _head_config_case(lambda m: m.update(family="eagle9")),
    "9-head-wrong-shape": case_head_wrong_shape,
    "9-resume-nonexistent": case_resume_nonexistent,
    "9-disk-full-at-checkpoint": case_disk_full_at_checkpoint,
    "10-negative-warmup": _train_flag("--optim.warmup_steps=-3", "command line", "'optim.warmup_steps'"),
    "10-min-lr-ratio-above-1": _train_flag("--optim.min_lr_ratio=5", "command line", "'optim.min_lr_ratio'"),
    "11-publish-stage-holds-user-file": case_publish_stage_holds_user_file,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(name: str, run_copy: Path, store: dict, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    build = CASES[name]
    kw = {"monkeypatch": monkeypatch} if "monkeypatch" in build.__code__.co_varnames else {}
    (tmp_path / "case").mkdir()
    case = build(tmp_path / "case", run_copy, store, **kw)
    before = snapshot(*case.watched)
    capsys.readouterr()
    rc = call(case.entry, case.argv)
    captured = capsys.readouterr()
    # exit 2: one `error:` line on stderr (progress bars and notes may precede it, never a traceback);
    # the verifier (exit 1) prints its one BAD line on stdout
    text = captured.err if case.code == 2 else captured.out + captured.err
    lines = [line for line in re.split(r"[\r\n]", text)
             if line.startswith("error: ") or (case.code == 1 and line.startswith("BAD "))]
    assert rc == case.code, f"exit code {rc}, want {case.code}; output:\n{captured.out[-2000:]}\n{captured.err[-3000:]}"
    assert len(lines) == 1 and "Traceback" not in text, f"not one error line:\n{text}"
    for needle in case.needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    assert snapshot(*case.watched) == before, "an input or output file was changed or deleted"


# ----------------------------------------------------------------------------------------------- not errors
def test_pickle_payload_in_checkpoint_never_runs(run_copy: Path, tmp_path: Path) -> None:
    """Row 2: accelerate would unpickle custom_checkpoint_0.pkl with weights_only=False; the payload would
    create the marker file. Refused, and the marker does not exist (with --trust-checkpoint too: our own
    checkpoints are read as safetensors, JSON and their own .pt files with weights_only, so the planted file
    is never opened)."""
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))

    for ckpt in (run_copy / "checkpoints").iterdir():  # torch.save: what accelerate's torch.load reads
        torch.save(Payload(), ckpt / "custom_checkpoint_0.pkl")
        torch.save(Payload(), ckpt / "random_states_0.pkl")
    # The payload is live: unpickled the way accelerate's load_custom_state does, it creates the marker.
    torch.load(run_copy / "checkpoints" / "step-00000002" / "custom_checkpoint_0.pkl", weights_only=False)
    assert marker.exists()
    marker.unlink()
    argv = ["--config", TINY, "--out", str(run_copy), "--resume", "auto", *RUN_FLAGS, "--train.max_steps=5"]
    assert call(train_main, argv) == 2
    assert not marker.exists()
    assert call(train_main, [*argv, "--trust-checkpoint"]) == 0
    assert not marker.exists()


def test_resume_applies_a_changed_lr_and_records_it(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    """Row 7: the new lr (and max_steps) apply from the resumed step, a `resume` event lists the changes,
    and config.yaml says what ran."""
    assert call(train_main, ["--config", TINY, "--out", str(run_copy), "--resume", "auto", *RUN_FLAGS,
                             "--train.max_steps=6", "--optim.lr=0.5"]) == 0
    r = rows(run_copy)
    resume = [x for x in r if x["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == STEPS
    assert resume[0]["changed"]["optim.lr"] == [1e-3, 0.5] and resume[0]["changed"]["train.max_steps"] == [4, 6]
    cfg = load_config(TINY, [*RUN_FLAGS, "--train.max_steps=6"])
    after = {x["step"]: x["lr"] for x in r if x["event"] == "train" and x["step"] > STEPS}
    for step, lr in after.items():  # the lr logged after step s is the one step s+1 runs with
        assert lr == pytest.approx(0.5 * lr_factor(step, cfg.optim.warmup_steps, 6, cfg.optim.min_lr_ratio))
    assert load_config(run_copy / "config.yaml").optim.lr == 0.5


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    """Row 8: an empty progress.json (a crash mid-write) in the newest checkpoint: warn, use the previous one."""
    (run_copy / "checkpoints" / "step-00000004" / "progress.json").write_text("")
    assert call(train_main, ["--config", TINY, "--out", str(run_copy), "--resume", "auto", *RUN_FLAGS,
                             "--train.max_steps=5"]) == 0
    captured = capsys.readouterr()
    assert "warning: skipping checkpoint" in captured.err and "step-00000004" in captured.err
    assert "resumed from" in captured.out and "step-00000002 at step 2" in captured.out
    starts = [x for x in rows(run_copy) if x["event"] == "start"]
    assert starts[-1]["start_step"] == 2


def test_corrupted_checkpoint_file_is_named(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    """A changed byte in a checkpoint's weights (checksums in progress.json): the explicit path is refused."""
    ckpt = run_copy / "checkpoints" / "step-00000004"
    _damage(ckpt / "model.safetensors")
    rc = call(train_main, ["--config", TINY, "--out", str(run_copy), "--resume", str(ckpt), *RUN_FLAGS])
    err = capsys.readouterr().err
    assert rc == 2 and f"{ckpt / 'model.safetensors'}: corrupted" in err


@pytest.mark.parametrize("name", ["state.pt", "rng.rank0.pt"])
def test_pickle_payload_in_a_state_file_never_runs(name: str, run_copy: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    """Row 2, the state files themselves: a payload in place of state.pt (or an RNG file), its sha256 in
    progress.json updated to match (as whoever planted it would), is refused by torch.load(weights_only=True):
    one line naming the file, exit 2, with --trust-checkpoint too, and the payload never ran."""
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))

    ckpt = run_copy / "checkpoints" / "step-00000004"
    torch.save({"optimizer": Payload(), "scaler": None}, ckpt / name)
    progress = json.loads((ckpt / "progress.json").read_text())
    progress["files"][name] = sha256_file(ckpt / name)
    (ckpt / "progress.json").write_text(json.dumps(progress))
    argv = ["--config", TINY, "--out", str(run_copy), "--resume", "auto", *RUN_FLAGS, "--train.max_steps=5"]
    for trust in ([], ["--trust-checkpoint"]):
        capsys.readouterr()
        assert call(train_main, [*argv, *trust]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert len(err) == 1 and f"{ckpt / name}: refused" in err[0] and "(io.open)" in err[0], err
        assert not marker.exists()


def test_resuming_a_finished_run_does_nothing(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    """Row 12: no second `end` row, no NaN in metrics.jsonl (strict JSON), exit 0."""
    before = snapshot(run_copy / "checkpoints", run_copy / "head")
    assert call(train_main, ["--config", TINY, "--out", str(run_copy), "--resume", "auto", *RUN_FLAGS]) == 0
    assert "already finished" in capsys.readouterr().out
    assert [x["event"] for x in rows(run_copy)].count("end") == 1
    assert snapshot(run_copy / "checkpoints", run_copy / "head") == before


def test_checkpoint_of_another_format_is_refused_by_name(tmp_path: Path) -> None:
    """A checkpoint of the earlier own format (state in safetensors + JSON) is refused, trusted or not; one
    with no format (accelerate's files, from before the own format) needs --trust-checkpoint."""
    (tmp_path / "progress.json").write_text(json.dumps({"step": 2, "format": "draftheads-state", "files": {}}))
    for trust in (False, True):
        with pytest.raises(train.checkpoint.TrainError, match="format 'draftheads-state' is not 'draftheads-state-2'"):
            train.checkpoint.read_checkpoint(tmp_path, trust=trust)
    (tmp_path / "progress.json").write_text(json.dumps({"step": 2, "files": {}}))
    with pytest.raises(train.checkpoint.TrainError, match="--trust-checkpoint"):
        train.checkpoint.read_checkpoint(tmp_path)
    assert train.checkpoint.read_checkpoint(tmp_path, trust=True)["step"] == 2
