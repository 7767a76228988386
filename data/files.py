"""Output folders that never lose or clobber anything: symlink refusal, ownership markers, locks, appends.

    from data.files import FolderLock, append_line, claim_folder, refuse_symlinks, replace_folder

    refuse_symlinks(out)                      # a symlink at or inside `out`: UserError naming it
    claim_folder(out, "eval", owns)           # `out` is eval's (a marker says so) or refused: one line
    with FolderLock(out, "training"):         # a second process on `out` is refused; a dead holder's lock is taken
        append_line(out / "metrics.jsonl", row)   # never through a symlink
    replace_folder(tmp, out)                  # a folder built beside `out` swapped in atomically

Why: a stage writes its outputs by name into a folder the user names. Without these checks a symlink
inside the folder makes it write through to any file, another stage's folder (a training run given to
eval.run --out) loses its files, and two processes on one folder interleave their writes. Every file is
still written atomically (data.cli.write_atomic: temp name in the same folder, rename).

The marker `.draftheads.json` names the stage that owns the folder; a folder without it is claimed only
when it holds nothing but the names the stage writes itself (its own outputs from before markers existed).
The lock `.lock` holds "pid host"; a lock whose pid is gone on this host is stale and taken over.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from data.cli import UserError, write_atomic

MARKER = ".draftheads.json"
LOCK = ".lock"


def refuse_symlinks(folder: str | Path, what: str = "output folder", tools: Iterable[str] = ()) -> None:
    """UserError when `folder` or anything below it is a symlink: writes there would land outside it.

    `tools` names subfolders another program owns and writes itself (wandb's `wandb/`): what lies below one is
    that program's bookkeeping (wandb links `latest-run` and its debug logs into ~/.cache), never written by
    us, so it is not walked; the subfolder itself must still be a real folder. That holds at any depth: a run
    folder may hold another run's folder (the quickstart trains its block drafter into OUT/dflash), whose
    `wandb/` is wandb's too."""
    folder = Path(folder)
    if folder.is_symlink():
        raise UserError(f"{folder}: the {what} is a symlink (to {os.readlink(folder)}); give the real folder")
    if not folder.is_dir():
        return
    for root, dirs, files in os.walk(folder):  # os.walk does not follow symlinked folders
        for name in dirs + files:
            p = Path(root) / name
            if p.is_symlink():
                raise UserError(f"{p}: a symlink inside the {what} (to {os.readlink(p)}); writes would go "
                                f"through it: remove it or choose another folder")
        dirs[:] = [d for d in dirs if d not in tools]  # checked above (not a symlink), not walked


def read_marker(folder: Path) -> str | None:
    """The stage named by `folder`'s marker, or None when it has none (or an unreadable one)."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data.get("stage") if isinstance(data, dict) else None


def claim_folder(folder: str | Path, stage: str, owns: Iterable[str]) -> Path:
    """Make `folder` `stage`'s output folder, or refuse (UserError, one line) when another stage or the user
    owns it: a marker naming another stage, or (no marker) an entry that is not one of `owns`."""
    folder = Path(folder)
    refuse_symlinks(folder)
    owner = read_marker(folder) if folder.is_dir() else None
    if owner is not None and owner != stage:
        raise UserError(f"{folder}: this folder is owned by stage '{owner}' ({folder / MARKER}); {stage} writes "
                        f"only into its own folders: choose another --out")
    if owner is None and folder.is_dir():
        foreign = sorted(p.name for p in folder.iterdir() if p.name not in set(owns) | {MARKER, LOCK})
        if foreign:
            raise UserError(f"{folder}: holds {foreign[0]}, which {stage} did not write; it writes only into an "
                            f"empty folder or one of its own: choose another --out")
    folder.mkdir(parents=True, exist_ok=True)
    if owner is None:
        write_atomic(folder / MARKER, json.dumps({"stage": stage}) + "\n")
    return folder


def append_line(path: str | Path, line: str) -> None:
    """Append `line` + newline to `path`, refusing a symlink there (O_NOFOLLOW), in one write call."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if Path(path).is_symlink():
            raise UserError(f"{path}: is a symlink; refusing to write through it") from None
        raise e
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


class FolderLock:
    """`folder/name` created exclusively for the `with` block; a second holder is refused with one line."""

    def __init__(self, folder: str | Path, what: str, name: str = LOCK):
        self.path = Path(folder) / name
        self.what = what
        self.owned = False
        self.created: list[Path] = []

    def _holder(self) -> tuple[int, str] | None:
        try:
            pid, host = self.path.read_text().split()[:2]
            return int(pid), host
        except (OSError, ValueError):
            return None  # being written right now, or damaged: treated as held

    def acquire(self) -> None:
        missing = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.created = missing  # removed again by release when still empty: a failed run leaves no folder
        for _ in range(2):  # the second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder and holder[1] == socket.gethostname() and not _alive(holder[0]):
                    self.path.unlink(missing_ok=True)  # its process died (killed): the lock is stale
                    continue
                who = f"process {holder[0]} on {holder[1]}" if holder else "another process"
                raise UserError(f"{self.path.parent}: {self.what} already running here ({who}; lock {self.path}); "
                                f"wait for it, or delete the lock if that process is gone") from None
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {socket.gethostname()}\n")
            self.owned = True
            return
        raise UserError(f"{self.path}: could not take the lock")

    def release(self) -> None:
        if self.owned:
            self.path.unlink(missing_ok=True)
            self.owned = False
        for d in self.created:
            try:
                d.rmdir()
            except OSError:
                break  # not empty: the run wrote there
        self.created = []

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return False
    at_fdcwd = -100
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_folder(tmp: str | Path, out: str | Path) -> Path:
    """Put the complete folder `tmp` (a sibling of `out`) in `out`'s place, then delete the previous `out`.

    With RENAME_EXCHANGE the swap is one step: a kill at any moment leaves the old folder or the new one in
    place (plus a hidden sibling the next run deletes). Without it, the old folder is first renamed aside."""
    tmp, out = Path(tmp), Path(out)
    if not out.exists():
        tmp.rename(out)
        return out
    if _exchange(tmp, out):
        shutil.rmtree(tmp)  # now the previous folder
        return out
    old = tmp.with_name(tmp.name + ".old")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old)
    return out
