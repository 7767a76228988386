"""The one error path of every command-line entry point, and the one atomic file write.

    from data.cli import UserError, cli_main, write_atomic

    @cli_main
    def main(argv: list[str] | None = None) -> int: ...

`cli_main` runs the entry point; a user error (a bad config value, bad data, a bad head or store, a
missing file, a full disk, a number out of range) becomes ONE line `error: <message>` on stderr and exit
code 2. Anything else is a bug and keeps its traceback. A user error is an instance of `UserError` (the
project's own error classes in data/, train/, eval/ and scripts/ derive from it), of heads.base.HeadError
(heads/ sits below data/ and cannot derive from this module), an OSError a user causes (missing file,
permission, full disk, read-only file system), or running out of (GPU) memory, which names the settings
that size the batches. Messages spanning lines are joined into one. Ctrl-C is one line too (exit 130).

`number_arg(flag, int, minimum)` / `names_arg(flag)` are argparse `type`s that check a range (or a
non-empty comma-separated list) at parse time and raise UserError: one line, exit 2, before any work.

`write_atomic(path, text_or_bytes)` writes under a temp name in the same folder, fsyncs and renames, so a
crash leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class UserError(Exception):
    """An error the user can fix; `cli_main` prints it as one line and exits with code 2."""


# OSErrors a user causes (a bug would rather raise EBADF, EINVAL, ...).
_USER_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EISDIR, errno.ENOTDIR,
                errno.EROFS, errno.EEXIST, errno.ENOTEMPTY, errno.ENAMETOOLONG}


def _user_error_types() -> tuple[type[BaseException], ...]:
    from heads.base import HeadError

    return (UserError, HeadError)


def is_user_error(e: BaseException) -> bool:
    if isinstance(e, _user_error_types()):
        return True
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return True
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch's, without importing torch
        return True
    return isinstance(e, OSError) and e.errno in _USER_ERRNOS


def one_line(e: BaseException) -> str:
    """The error as one line; an OSError names its file (disk full says so)."""
    if isinstance(e, OSError) and not isinstance(e, _user_error_types()) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        hint = " (free space on that disk and rerun)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        text = f"{where}{e.strerror}{hint}"
    elif isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        first = (str(e).strip().splitlines() or [""])[0]
        text = (f"out of memory ({first or type(e).__name__}); lower the batch (train.batch_size, "
                f"features.batch_tokens, regenerate.batch_size) or the lengths (data.max_length)")
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def cli_main(fn: F) -> F:
    """Decorate an entry point: user errors -> one `error:` line on stderr and SystemExit(2)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:  # Ctrl-C: the user knows; one line, no traceback (130 = 128 + SIGINT)
            print("error: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        except Exception as e:
            if not is_user_error(e):
                raise
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]


def number_arg(flag: str, kind: type = int, minimum: float = 1, many: bool = False) -> Callable[[str], Any]:
    """argparse `type` for `flag`: a finite `kind` >= minimum, or with `many` a non-empty comma-separated
    list of them; anything else (0, -1, nan, an empty list) is a UserError naming the flag."""

    def parse(text: str) -> Any:
        items = [x for x in (x.strip() for x in (text.split(",") if many else [text])) if x]
        try:
            values = [kind(x) for x in items]
        except ValueError:
            values = []
        if not values or any(not math.isfinite(v) or v < minimum for v in values):
            noun = "integer" if kind is int else "number"
            what = f"a comma-separated list of {noun}s" if many else f"an {noun}" if kind is int else f"a {noun}"
            raise UserError(f"{flag}: expected {what} >= {minimum:g}, got '{text}'")
        return values if many else values[0]

    return parse


def names_arg(flag: str) -> Callable[[str], list[str]]:
    """argparse `type` for `flag`: a non-empty comma-separated list of names (UserError when empty)."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        if not names:
            raise UserError(f"{flag}: expected a comma-separated list of names, got '{text}'")
        return names

    return parse


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` through a temp file in the same folder: write, fsync, rename, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some file systems cannot fsync a folder; the rename itself is still atomic
    return path
