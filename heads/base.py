"""The family registry, the head config base, and the head folder format (save, read, check, load).

A family is a module (or package) in `heads/` (`eagle/`, `medusa.py`, `mtp.py`) that provides:

    CONFIGS: dict[str, type[HeadConfig]]          family name -> its config dataclass
    feature_layers(cfg, target_config) -> list[int]   hidden_states indices the head needs as `aux`
    build(cfg, target: TargetIO) -> nn.Module         a fresh head (frozen target parts are NOT inside it)
    loss(head, batch, target: TargetIO) -> (loss, metrics)   metrics has per-position top-1 (`top1/0`, ...)
    drafter(head, target: TargetIO, **kw) -> Drafter  the decoder adapter (see heads.types.Drafter)
    drafter_factory(head, target, tree="auto", k=4) -> () -> Drafter   eval.tree mapped onto drafter's options
    prepare(cfg, dataset, target) -> dict[str, Tensor]   optional: data-derived initial tensors

A head folder is what `save_head` writes and `load_head` reads (`config.json` + `model.safetensors`);
`load_head` refuses a folder whose target (hidden size, vocab, layers, fingerprint) does not match, whose
weights differ from the sha256 config.json records, or hold NaN/inf (HeadError, one line at the CLI).

The shared types (Features, TargetIO, DraftTree, Drafter, target_record, target_fingerprint) live in
heads.types, the drafters' KV cache helpers (cache_kwarg) in heads.cache, shift_targets in heads.align; this
module re-exports them so `from heads.base import X` keeps working.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from heads.align import shift_targets
from heads.cache import cache_kwarg
from heads.types import Drafter, DraftTree, Features, TargetIO, target_fingerprint, target_record

__all__ = [
    # re-exported from heads.types, heads.cache and heads.align (importers across the repo use heads.base)
    "DraftTree", "Drafter", "Features", "TargetIO", "cache_kwarg", "shift_targets", "target_fingerprint",
    "target_record",
    # defined here
    "FAMILIES", "FORMAT_VERSION", "HeadConfig", "HeadError", "HeadMismatchError", "check_eval_tree", "check_finite",
    "check_target", "family_module", "load_head", "read_head_config", "save_head", "sha256_file",
]

FORMAT_VERSION = 1

# family name -> module implementing it; eval and export rebuild any head from its folder through this.
FAMILIES: dict[str, str] = {
    "eagle1": "heads.eagle",
    "eagle3": "heads.eagle",
    "dflash": "heads.dflash",
    "medusa": "heads.medusa",
    "mtp": "heads.mtp",
}


class HeadError(ValueError):
    """A head folder is unusable (unreadable, truncated, tampered, non-finite; the message names the file),
    or a head cannot draft as asked (an eval.tree its family has not).

    data.cli.cli_main reports it (and every subclass) as one line with exit code 2."""


class HeadMismatchError(HeadError):
    """A head folder does not fit the target (or the store); the message names the mismatch."""


def family_module(family: str) -> Any:
    if family not in FAMILIES:
        raise ValueError(f"unknown head family '{family}' (known: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[family])


def check_eval_tree(tree: str, family: str, available: tuple[str, ...]) -> None:
    """Refuse an eval.tree value the family's drafter_factory cannot map ("auto", the default, always maps)."""
    if tree != "auto" and tree not in available:
        raise HeadError(f"eval.tree '{tree}' is not available for a {family} head")


@dataclass
class HeadConfig:
    """Base of every family's head config; `family` picks the dataclass (see `resolve_class`)."""

    family: str = "eagle3"

    @classmethod
    def resolve_class(cls, data: dict) -> type[HeadConfig]:
        family = data.get("family", "eagle3")
        if family not in FAMILIES:
            raise ValueError(f"unknown head family '{family}' (known: {', '.join(sorted(FAMILIES))})")
        return family_module(family).CONFIGS[family]


# ----------------------------------------------------------------------------------------------- folders
def sha256_file(path: str | Path, chunk: int = 1 << 23) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_finite(state: dict[str, torch.Tensor], where: str) -> None:
    """HeadError naming the first float tensor holding NaN or inf (a diverged run or a damaged file)."""
    for k, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            n = int((~torch.isfinite(v)).sum())
            raise HeadError(f"{where}: weight '{k}' holds {n} non-finite values (NaN/inf): a diverged run or a "
                            f"damaged file; nothing is trusted from it")


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(final)


def save_head(path: str | Path, head: nn.Module, cfg: HeadConfig, target: TargetIO, extra: dict | None = None) -> Path:
    """Write `path/config.json` and `path/model.safetensors` (temp names, fsync, rename; weights first).

    config.json records the sha256 of model.safetensors (`files`), checked by load_head; non-finite
    weights are refused (HeadError) before anything is written."""
    out = Path(path)
    mod = family_module(cfg.family)
    layer_ids = list(mod.feature_layers(cfg, target.config))
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    check_finite(state, str(out))
    out.mkdir(parents=True, exist_ok=True)
    floats = [v for v in state.values() if v.is_floating_point()]  # skip index buffers such as d2t
    dtype = str(floats[0].dtype).replace("torch.", "") if floats else "float32"
    meta = {
        "format": "draftheads",
        "format_version": FORMAT_VERSION,
        "family": cfg.family,
        "head_config": dataclasses.asdict(cfg),
        "target": target.record(),
        "layer_ids": layer_ids,
        "dtype": dtype,
        "extra": extra or {},
    }
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt", "family": cfg.family})
    meta["files"] = {"model.safetensors": sha256_file(tmp)}
    _fsync_replace(tmp, out / "model.safetensors")
    (out / "config.json.tmp").write_text(json.dumps(meta, indent=2))
    _fsync_replace(out / "config.json.tmp", out / "config.json")
    return out


def read_head_config(path: str | Path) -> tuple[HeadConfig, dict]:
    """Read a head folder's config.json: (the family's config dataclass, the whole json)."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise HeadError(f"{folder}: not a head folder (no config.json)")
    try:
        meta = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "draftheads":
        raise HeadError(f"{cfg_path}: not a draftheads head folder (use scripts/export.py --import for other layouts)")
    family = meta.get("family")
    if family not in FAMILIES:
        raise HeadError(f"{cfg_path}: key 'family' is {family!r}, not one of {', '.join(sorted(FAMILIES))}")
    raw = meta.get("head_config")
    if not isinstance(raw, dict) or raw.get("family", family) != family:
        raise HeadError(f"{cfg_path}: key 'head_config' is missing or names another family than 'family' ({family})")
    for key in ("target", "layer_ids"):
        if not isinstance(meta.get(key), dict if key == "target" else list):
            raise HeadError(f"{cfg_path}: key '{key}' is missing or malformed")
    cls = family_module(family).CONFIGS[family]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise HeadError(f"{cfg_path}: unknown head_config key '{unknown[0]}' for family {family}")
    kwargs = {k: tuple(v) if isinstance(getattr(cls, k, None), tuple) else v for k, v in raw.items()}
    try:
        return cls(**kwargs), meta
    except (TypeError, ValueError) as e:
        raise HeadError(f"{cfg_path}: key 'head_config': {e}") from None


def check_target(recorded: dict, target: TargetIO | dict, where: str, strict_fingerprint: bool = True,
                 error: type[HeadMismatchError] | None = None) -> None:
    """The one target check (extraction, training offline and on resume, eval, export): refuse what
    `recorded` (a head folder's or store manifest's `target`) says against `target` (a TargetIO or a
    record), naming the first mismatch and both sides. A missing field (a record read from the config
    alone has no fingerprint) is not compared."""
    err = error or HeadMismatchError
    if not isinstance(recorded, dict):
        raise err(f"{where}: no target record")
    t, have = recorded, target if isinstance(target, dict) else target.record()
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if t.get(key) is not None and have.get(key) is not None and int(t[key]) != int(have[key]):
            raise err(f"{where}: {key} is {t[key]} but the target has {have[key]}")
    if strict_fingerprint and t.get("fingerprint") and have.get("fingerprint") and t["fingerprint"] != have["fingerprint"]:
        raise err(
            f"{where}: made for target '{t.get('name_or_path')}' (fingerprint {t['fingerprint']}), "
            f"but the target is '{have.get('name_or_path')}' (fingerprint {have['fingerprint']})"
        )


def load_head(path: str | Path, target: TargetIO, strict_fingerprint: bool = True) -> tuple[nn.Module, HeadConfig, dict]:
    """Rebuild a head from its folder for `target`; refuses a mismatch (hidden, vocab, layers, ids)."""
    folder = Path(path)
    cfg, meta = read_head_config(folder)
    check_target(meta["target"], target, str(folder), strict_fingerprint)
    mod = family_module(cfg.family)
    want_layers = list(mod.feature_layers(cfg, target.config))
    if list(meta.get("layer_ids", [])) != want_layers:
        raise HeadMismatchError(
            f"{folder}: layer_ids {meta.get('layer_ids')} do not match {want_layers} for this target"
        )
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise HeadError(f"{weights}: missing")
    want_sha = meta.get("files", {}).get("model.safetensors") if isinstance(meta.get("files"), dict) else None
    if want_sha is not None and sha256_file(weights) != want_sha:
        raise HeadError(f"{weights}: corrupted or changed (sha256 differs from {folder / 'config.json'})")
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise HeadError(f"{weights}: unreadable or truncated ({' '.join(str(e).split())})") from None
    check_finite(state, str(weights))
    try:
        head = mod.build(cfg, target)
    except ValueError as e:
        raise HeadMismatchError(f"{folder / 'config.json'}: head_config does not fit this target ({e})") from None
    own = head.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise HeadMismatchError(f"{weights}: missing keys {missing[:3]} / unexpected keys {unexpected[:3]}")
    for k, v in own.items():  # before load_state_dict, which would raise a bare RuntimeError
        if v.shape != state[k].shape:
            raise HeadMismatchError(f"{weights}: {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    head.load_state_dict(state)
    head.eval()
    return head, cfg, meta
