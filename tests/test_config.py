"""Config loading: every file in configs/ loads; unknown keys and wrong types name the key and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.config import ConfigError, RunConfig, load_config, save_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.head.family in ("eagle1", "eagle3", "medusa", "mtp")


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


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "dup.yaml"
    p.write_text("features:\n  mode: offline\ntrain:\n  epochs: 1\nfeatures:\n  mode: online\n")
    with pytest.raises(ConfigError, match=r"(?s)dup.yaml.*duplicate key 'features'.*line 5"):
        load_config(p)
