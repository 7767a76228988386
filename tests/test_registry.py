"""The head family registry (heads/registry.py) and its claim: a new family is one folder.

    .venv/bin/python -m pytest -q tests/test_registry.py

The unit tests ask the registry itself (lookup, one-line errors, refused registrations, entry scripts) and
what reads it (the native spec's `head_family` rule, convert's native-only default). The end-to-end test
copies the repository into a temp folder, drops in a toy fifth family as ONE folder, `heads/toy/`
(tests/toy_family.py as its `__init__.py`, its tiny config beside it), and, in subprocesses of the copy
(each in its own process group, killed whole on a timeout: tests/procs.py), runs the structure and
per-family tests, trains the toy head with `python -m train`, evaluates it with `python -m eval.run`
(greedy output identical to plain decoding) and exports it with `scripts/export.py --to native`, with no
edit anywhere else. ~1-2 min on 2 busy CPU cores.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from procs import communicate, start
from toy_family import TINY_YAML  # importing it registers nothing: only heads/ modules are discovered

from convert import ExportError, check_config, load_spec, served_by_vllm
from convert.registry import NATIVE_ONLY
from heads import registry
from heads.base import HeadConfig

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("heads", "data", "eval", "train", "convert", "configs", "scripts", "tests")
TIMEOUT_S = 600


def test_get_names_and_the_one_line_error_for_an_unknown_family():
    assert set(registry.names()) >= {"eagle1", "eagle3", "medusa", "mtp"}
    assert list(registry.names()) == sorted(registry.names())
    assert registry.get("medusa").name == "medusa" and registry.get("medusa").config().family == "medusa"
    known = ", ".join(registry.names())
    with pytest.raises(ValueError, match=rf"^unknown head family 'hydra' \(known: {known}\)$"):
        registry.get("hydra")
    with pytest.raises(ValueError, match="unknown head family"):
        HeadConfig.resolve_class({"family": "hydra"})
    assert HeadConfig.resolve_class({"family": "mtp"}) is registry.get("mtp").config


def test_register_refuses_a_second_family_of_a_name_and_a_config_of_another_family():
    medusa = registry.get("medusa")
    assert registry.register(medusa) is medusa  # the same object again: nothing changes
    with pytest.raises(ValueError, match="^head family 'medusa' is registered twice$"):
        registry.register(replace(medusa, trees=()))

    @dataclass
    class HydraConfig(HeadConfig):
        family: str = "medusa"  # forgot to change it

    with pytest.raises(ValueError, match="its config HydraConfig has family 'medusa'"):
        registry.register(replace(medusa, name="hydra", config=HydraConfig))
    assert "hydra" not in registry.names()


def test_entry_scripts_ask_the_registry_which_families_they_train():
    assert registry.trained_by("eagle") == ("eagle1", "eagle3")
    assert registry.trained_by("medusa") == ("medusa",) and registry.trained_by("mtp") == ("mtp",)
    for name in registry.names():
        script = registry.get(name).script
        assert not script or (ROOT / "train" / f"{script}.py").is_file()
    with pytest.raises(ValueError, match="no head family names train/loop.py"):
        registry.trained_by("loop")  # an empty answer would let the script train any family


def test_native_spec_takes_its_families_from_the_registry():
    """native.json lists no families (`head_family: true`): every registered one passes, nothing else."""
    spec = load_spec("native")
    meta = {"format": "draftheads", "format_version": 1, "head_config": {}, "layer_ids": [], "dtype": "float32",
            "target": {"name_or_path": "t", "fingerprint": "f", "hidden_size": 1, "vocab_size": 1,
                       "num_hidden_layers": 1}}
    for name in registry.names():
        check_config(spec, {**meta, "family": name}, "x")
    with pytest.raises(ExportError, match=r"^x: config key 'family' must be one of \[.*'mtp'.*\], got 'hydra'$"):
        check_config(spec, {**meta, "family": "hydra"}, "x")


def test_a_family_without_a_convert_module_is_native_only():
    assert served_by_vllm("hydra") == (None, NATIVE_ONLY)
    assert served_by_vllm("eagle3")[0] is not None


# ----------------------------------------------------------------------------------------------- one folder
@pytest.fixture(scope="module")
def repo_with_toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the repository with one folder added: heads/toy/ (__init__.py + tiny.yaml)."""
    root = tmp_path_factory.mktemp("repo")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".venv", "runs", ".pytest_cache")
    for name in COPIED:
        shutil.copytree(ROOT / name, root / name, ignore=skip)
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    assert not (root / "heads" / "toy").exists()
    toy = root / "heads" / "toy"
    toy.mkdir()
    shutil.copy2(ROOT / "tests" / "toy_family.py", toy / "__init__.py")
    (toy / "tiny.yaml").write_text(TINY_YAML)
    return root


def _run(root: Path, args: list[str]):
    """Start `python ARGS` in the copy (its own modules first on the path), in its own process group."""
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return start([sys.executable, *args], merge_stderr=True, cwd=root, env=env)


def _finish(proc) -> str:
    out, _ = communicate(proc, TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(map(str, proc.args))} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def test_a_new_family_is_one_folder(repo_with_toy: Path):
    root = repo_with_toy
    # The structure rules and the per-family tests pick the toy family up from the registry of the copy.
    checks = _run(root, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_structure.py",
                         "tests/test_heads.py", "-k", "toy or structure or offences or layers or longer or pending"])
    train = _run(root, ["-m", "train", "--config", "heads/toy/tiny.yaml", "--out", "runs/toy"])
    out = _finish(train)
    assert "head saved to runs/toy/head" in out
    events = [json.loads(line) for line in (root / "runs/toy/metrics.jsonl").read_text().splitlines()]
    assert events[0]["family"] == "toy" and events[-1]["event"] == "end" and events[-1]["step"] == 4
    evals = [e for e in events if e["event"] == "eval"]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]  # four steps already learn something

    ev = _run(root, ["-m", "eval.run", "--head", "runs/toy/head", "--out", "runs/toy/eval", "--bench", "mt_bench",
                     "--max-questions", "1", "--max-new-tokens", "8", "--k", "2", "--temperature", "0",
                     "--batch-sizes", "1", "--sweep-new-tokens", "4", "--baselines", ""])
    export = _run(root, ["scripts/export.py", "--head", "runs/toy/head", "--to", "native", "--out", "exports/toy"])
    _finish(ev)
    report = json.loads((root / "runs/toy/eval/report.json").read_text())
    bench = report["benchmarks"]["mt_bench"]
    assert report["methods"] == ["plain", "toy"] and bench["tau"] >= 1.0
    assert bench["identical"] is True  # greedy: exactly the plain decoding
    assert "checked against convert/formats/native.json" in _finish(export)
    assert json.loads((root / "exports/toy/config.json").read_text())["family"] == "toy"

    summary = _finish(checks).strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary and "error" not in summary, summary
