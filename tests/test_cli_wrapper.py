"""data/cli.py on its own: cli_main turns user errors into one line and exit 2 and lets bugs through with
their traceback; write_atomic never leaves half a file.

    .venv/bin/python -m pytest -q tests/test_cli_wrapper.py
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from data.cli import UserError, cli_main, write_atomic
from heads.base import HeadMismatchError


@pytest.mark.parametrize(("exc", "line"), [
    (UserError("c.yaml: key 'optim.lr':\n  must be > 0"), "error: c.yaml: key 'optim.lr': must be > 0"),
    (HeadMismatchError("H: hidden_size is 64 but the target has 32"), "error: H: hidden_size is 64 but the target has 32"),
    (OSError(errno.ENOSPC, "No space left on device", "/d/x.bin"),
     "error: /d/x.bin: No space left on device (free space on that disk and rerun)"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/d/c.yaml"),
     "error: /d/c.yaml: No such file or directory"),
    (MemoryError(), "error: out of memory (MemoryError); lower the batch (train.batch_size, features.batch_tokens, "
                    "regenerate.batch_size) or the lengths (data.max_length)"),
])
def test_user_error_is_one_line_and_exit_2(exc: BaseException, line: str, capsys: pytest.CaptureFixture) -> None:
    @cli_main
    def main() -> None:
        raise exc

    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize("exc", [KeyError("x"), RuntimeError("bug"), ValueError("bug"),
                                 OSError(errno.EBADF, "Bad file descriptor")])
def test_bugs_keep_their_traceback(exc: BaseException, capsys: pytest.CaptureFixture) -> None:
    @cli_main
    def main() -> None:
        raise exc

    with pytest.raises(type(exc)):
        main()
    assert capsys.readouterr().err == ""


def test_return_value_passes_through() -> None:
    assert cli_main(lambda a: a + 1)(1) == 2


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "progress.json"
    write_atomic(path, '{"step": 1}')

    def crash(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        write_atomic(path, '{"step": 2}')
    assert path.read_text() == '{"step": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress.json"]  # no temp file left
    monkeypatch.undo()
    write_atomic(path, b"\x00raw")
    assert path.read_bytes() == b"\x00raw"
