"""Folder I/O for every layout: read and check a folder, refuse to overwrite results, write atomically.

A write builds nothing on disk until the in-memory export passes its spec, then writes a fresh temporary
folder next to `out`, checks the files read back (what engines will read), and swaps it into place
(data.files.replace_folder): a kill at any moment leaves the previous export or the new one, never a mix,
and the next run deletes the temporary folders a killed one left. Every export holds the marker
data.files.MARKER (stage "export"). `--force` never replaces a run folder, a head folder, a feature store
or the command's own input; a native export (a head folder) is replaced when its marker says it is one.
A symlinked `out` is refused.
Library only; scripts/export.py is the command line.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from convert.spec import ExportError, check_config, load_spec, validate
from data.cli import write_atomic
from data.files import MARKER, read_marker, replace_folder
from heads.base import HeadConfig, TargetIO, check_finite, load_head, read_head_config, save_head


def read_folder(folder: str | Path, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of a folder in layout `fmt`; safetensors only (pickled .bin/.pt files are refused)."""
    folder = Path(folder)
    spec = load_spec(fmt)
    cfg_path, w_path = folder / spec["files"]["config"], folder / spec["files"]["weights"]
    if not cfg_path.is_file():
        raise ExportError(f"{cfg_path}: missing ({fmt} format)")
    if not w_path.is_file():
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {pickles[0]}: pickled weights are not loaded; convert them to safetensors)" if pickles else ""
        raise ExportError(f"{w_path}: missing ({fmt} format){hint}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{cfg_path}: invalid JSON ({e})") from None
    try:
        state = load_file(str(w_path))
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise ExportError(f"{w_path}: unreadable or truncated ({e})") from None
    check_finite(state, str(w_path))
    return config, state


def validate_folder(folder: str | Path, fmt: str, target: TargetIO | None = None) -> dict[str, int]:
    """Read a folder and check it against the spec of `fmt` (native folders go through load_head)."""
    folder = Path(folder)
    if fmt == "native":
        _, meta = read_head_config(folder)
        check_config(load_spec("native"), meta, str(folder / "config.json"))
        if target is not None:
            load_head(folder, target)
        return {}
    config, state = read_folder(folder, fmt)
    return validate(fmt, config, state, target, where=str(folder))


def _protected_kind(folder: Path) -> str | None:
    """What `folder` is when it must never be replaced: a run folder, a head folder or a feature store
    (an export's own folder, marked so, is none of them)."""
    if read_marker(folder) == "export":
        return None
    if (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file() or \
            (folder / "progress.json").is_file():
        return "a run folder"
    cfg = folder / "config.json"
    if cfg.is_file():
        try:
            if json.loads(cfg.read_text()).get("format") == "draftheads":
                return "a head folder"
        except (ValueError, OSError, AttributeError):
            pass
    if (folder / "manifest.json").is_file() or (folder / "store.json").is_file():
        return "a feature store"
    return None


def check_replaceable(out: str | Path, inputs: tuple[str | Path, ...] = ()) -> None:
    """Refuse (ExportError) to replace `out` when it is, contains or lies inside a run folder, a head folder,
    a feature store or one of `inputs` (--force must never delete training results or the source)."""
    o = Path(out).resolve()
    for inp in inputs:
        i = Path(inp).resolve()
        if o == i or i in o.parents or o in i.parents:
            raise ExportError(f"{out}: --force would replace {inp}, the input of this command (choose another --out)")
    for d in (o, *o.parents):
        kind = _protected_kind(d)
        if kind:
            where = "is" if d == o else f"lies inside {d}, which is"
            raise ExportError(f"{out}: refusing to replace it: it {where} {kind} (choose a new --out)")
    if o.is_dir():
        for d in o.rglob("*"):
            kind = _protected_kind(d) if d.is_dir() else None
            if kind:
                raise ExportError(f"{out}: refusing to replace it: it contains {d}, {kind} (choose a new --out)")


def check_out(out: str | Path, force: bool, inputs: tuple[str | Path, ...] = ()) -> None:
    """Refuse a non-empty `out` unless `force`, and even then when check_replaceable refuses it."""
    out = Path(out)
    if out.is_symlink():
        raise ExportError(f"{out}: is a symlink (to {out.readlink()}); give the real folder as --out")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ExportError(f"{out}: exists and is not empty (pass force=True / --force to replace it)")
        check_replaceable(out, inputs)


def _fresh_tmp(out: Path) -> Path:
    """A new temporary folder beside `out`, after deleting those a killed export to `out` left (ours: the prefix)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.tmp-export-"
    for stale in out.parent.glob(prefix + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    write_atomic(tmp / MARKER, json.dumps({"stage": "export"}) + "\n")
    return tmp


def _commit(tmp: Path, out: Path, fmt: str, target: TargetIO | None) -> Path:
    """Check the files in `tmp` read back (what engines will read), then swap `tmp` into `out`'s place."""
    try:
        validate_folder(tmp, fmt, target)
    except BaseException:
        shutil.rmtree(tmp)
        raise
    return replace_folder(tmp, out)


def write_folder(out: str | Path, fmt: str, config: dict, weights: dict[str, torch.Tensor], force: bool = False,
                 target: TargetIO | None = None, inputs: tuple[str | Path, ...] = ()) -> Path:
    """Write a validated export to `out` via a fresh temporary folder, re-checking the files read back.

    An existing non-empty `out` is replaced only with `force`, and never when check_replaceable refuses it."""
    out = Path(out)
    check_out(out, force, inputs)
    spec = load_spec(fmt)
    validate(fmt, config, weights, target, where=f"{fmt} export to {out}")  # nothing is written if this fails
    tmp = _fresh_tmp(out)
    try:
        save_file(weights, str(tmp / spec["files"]["weights"]), metadata={"format": "pt"})
        write_atomic(tmp / spec["files"]["config"], json.dumps(config, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp)
        raise
    return _commit(tmp, out, fmt, target)


def write_head_folder(out: str | Path, head: torch.nn.Module, cfg: HeadConfig, target: TargetIO, extra: dict,
                      force: bool = False, inputs: tuple[str | Path, ...] = ()) -> Path:
    """A native head folder at `out` (save_head), built and checked beside it and swapped in like write_folder."""
    out = Path(out)
    check_out(out, force, inputs)
    tmp = _fresh_tmp(out)
    try:
        save_head(tmp, head, cfg, target, extra=extra)
    except BaseException:
        shutil.rmtree(tmp)
        raise
    return _commit(tmp, out, "native", target)
