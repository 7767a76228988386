"""Config loading: every file in configs/ loads; unknown keys and wrong types name the key and file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from data.config import ConfigError, RunConfig, TargetConfig, load_config, save_config
from heads import registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads(path: Path) -> None:
    from data.prompts import check_prompts_config

    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.head.family in registry.names()
    check_prompts_config(cfg.prompts)  # what data.prompts refuses before writing (context domains included)


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("optim:\n  lr: 1e-4\n  learning_rate: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*'optim.learning_rate'"):
        load_config(p)


def test_wrong_type_names_key(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  batch_size: four\n")
    with pytest.raises(ConfigError, match=r"'train.batch_size'.*int"):
        load_config(p)


def test_head_family_selects_dataclass(tmp_path: Path) -> None:
    p = tmp_path / "h.yaml"
    p.write_text("head:\n  family: medusa\n  num_heads: 3\n")
    assert load_config(p).head.num_heads == 3
    p.write_text("head:\n  family: eagle3\n  num_heads: 3\n")  # a Medusa key in an EAGLE head
    with pytest.raises(ConfigError, match="'head.num_heads'"):
        load_config(p)


def test_dotted_overrides_and_saved_config(tmp_path: Path) -> None:
    cfg = load_config(None, ["--optim.lr=3e-4", "--head.ttt_length=3", "--eval.bench=[gsm8k,humaneval]"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.head.ttt_length == 3
    assert cfg.eval.bench == ["gsm8k", "humaneval"]
    with pytest.raises(ConfigError, match="command line.*'optim.lrr'"):
        load_config(None, ["--optim.lrr=1"])
    path = save_config(cfg, tmp_path)
    again = load_config(path)
    assert again == cfg


def test_yes_no_on_off_are_strings_as_in_yaml_1_2(tmp_path: Path) -> None:
    """`no` is one of train.mixed_precision's choices: YAML 1.1 (PyYAML's default) would read it as False, on the
    command line (scripts/quickstart.sh passes --train.mixed_precision=no on a CPU without bfloat16) and in a
    file. Only true / false are booleans; `yes` for a boolean key is refused, naming it."""
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  mixed_precision: no\n  keep_best: true\n")
    assert load_config(p).train.mixed_precision == "no" and load_config(p).train.keep_best is True
    assert load_config(None, ["--train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_config(None, ["--train.keep_best=False"]).train.keep_best is False
    with pytest.raises(ConfigError, match="'train.keep_best': should be a valid boolean, got 'yes'"):
        load_config(None, ["--train.keep_best=yes"])


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "dup.yaml"
    p.write_text("features:\n  mode: offline\ntrain:\n  epochs: 1\nfeatures:\n  mode: online\n")
    with pytest.raises(ConfigError, match=r"(?s)dup.yaml.*duplicate key 'features'.*line 5"):
        load_config(p)


@pytest.mark.parametrize("text, needles", [
    # the YAML line of the bad key, the dotted key, what it must be (in pydantic's words)
    ("optim:\n  lr: 1e-4\n  min_lr_ratio: 5\n", ("c.yaml:3:", "'optim.min_lr_ratio'", "less than or equal to 1, got 5")),
    ("optim:\n  lr: .nan\n", ("c.yaml:2:", "'optim.lr'", "finite number")),
    ("regenerate:\n  top_p: 0\n", ("c.yaml:2:", "'regenerate.top_p'", "greater than 0")),
    ("eval:\n  temperature: [0.0,\n    -1]\n", ("c.yaml:3:", "'eval.temperature[1]'", "greater than or equal to 0, got -1")),
    ("optim:\n  betas: [0.9]\n", ("'optim.betas'", "at least 2 items")),
    # strict leaves: no "5" for an int, no 1 for a bool, no 5 for a str (in the head section too)
    ("train:\n  epochs: '5'\n", ("'train.epochs'", "valid integer")),
    ("target:\n  trust_remote_code: 1\n", ("c.yaml:2:", "'target.trust_remote_code'", "valid boolean")),
    ("target:\n  revision: 5\n", ("'target.revision'", "valid string")),
    ("head:\n  family: mtp\n  recursive: yes_please\n", ("c.yaml:3:", "'head.recursive'", "valid boolean")),
    ("head:\n  ttt_length: 3.0\n", ("'head.ttt_length'", "valid integer")),
    # closed sets of strings (Literal), unknown keys (with a close match), the head family
    ("features:\n  mode: ofline\n", ("c.yaml:2:", "'features.mode'", "should be 'offline' or 'online', got 'ofline'")),
    ("eval:\n  policy: smart\n", ("c.yaml:2:", "'eval.policy'", "should be 'adaptive' or 'fixed', got 'smart'")),
    ("regenerate:\n  engine: sglang\n", ("c.yaml:2:", "'regenerate.engine'", "should be 'hf' or 'vllm'")),
    ("optim:\n  lrr: 1\n", ("c.yaml:2:", "unknown key 'optim.lrr'", "did you mean 'lr'?", "known in 'optim'")),
    ("prompts:\n  domains:\n    - name: a\n      wieght: 2\n", ("c.yaml:4:", "'prompts.domains[0].wieght'", "'weight'")),
    ("head:\n  family: eagle9\n", ("c.yaml:2:", "'head.family'", "unknown head family 'eagle9'")),
    ("head: 3\n", ("'head'", "expected a mapping")),
    ("1: 2\n", ("unknown key '1'",)),
])
def test_bad_value_is_one_line_naming_line_and_key(tmp_path: Path, text: str, needles: tuple[str, ...]) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_override_errors_name_the_command_line_and_yaml_12_floats(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 5e-4\n  min_lr_ratio: 0.5\nhead:\n  family: eagle1\n")
    cfg = load_config(p, ["--head.noise=2e-1"])  # `5e-4` (no dot) is a float, in files and on the command line
    assert cfg.optim.lr == 5e-4 and cfg.head.noise == pytest.approx(0.2)
    with pytest.raises(ConfigError, match=r"^command line \(.*c\.yaml \+ overrides\): key 'optim\.lr': should be greater than 0"):
        load_config(p, ["--optim.lr=-1"])
    # a bad key that came from the file keeps its file line even when overrides are given
    p.write_text("optim:\n  lr: 5e-4\n  min_lr_ratio: 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: key 'optim\.min_lr_ratio'"):
        load_config(p, ["--optim.lr=1e-3"])


def test_config_objects_stay_plain_dataclasses() -> None:
    """Building a section in code checks nothing (data.target reports a bad dtype itself) and
    dataclasses.replace works; only load_config validates."""
    t = TargetConfig(dtype="fp8")
    assert dataclasses.replace(t, device="cpu").dtype == "fp8"
    assert type(load_config(None, ["--head.family=medusa"]).head).__module__ == "heads.medusa"
