"""The test subprocess helper (tests/procs.py) cannot hang: a child that sleeps forever, and a grandchild
that keeps the output pipe open after its parent dies (what hung test_distributed for 26 minutes), are
both killed with their process group on timeout, within seconds.

    .venv/bin/python -m pytest -q tests/test_procs.py
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from procs import finish, free_port, kill_when, run, start

# The grandchild prints its pid, then sleeps forever holding the inherited stdout; the parent also sleeps.
GRANDCHILD = ("import subprocess, sys, time; "
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)']); "
              "print(g.pid, flush=True); time.sleep(3600)")
# torch's elastic agent pattern: the worker starts a session of its own, so a group kill misses it.
OWN_SESSION = ("import subprocess, sys, time; "
               "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'], start_new_session=True); "
               "print(g.pid, flush=True); time.sleep(3600)")
ORPHAN = ("import os, subprocess, sys; "
          "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)']); "
          "print(g.pid, flush=True); os._exit(0)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of a process that is gone is reaped by init; a zombie still answers kill(0).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_child_that_sleeps_forever_is_killed_on_timeout() -> None:
    t0 = time.monotonic()
    proc = start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(3600)"])
    with pytest.raises(TimeoutError, match="did not finish in 2 s") as e:
        finish(proc, timeout=2)
    assert "up" in str(e.value)  # the output so far comes with the error
    assert proc.returncode is not None and time.monotonic() - t0 < 15


@pytest.mark.parametrize("script", [GRANDCHILD, ORPHAN, OWN_SESSION],
                         ids=["parent-sleeps", "parent-exits", "grandchild-own-session"])
def test_grandchild_holding_the_pipe_is_killed_with_the_group(script: str) -> None:
    t0 = time.monotonic()
    proc = start([sys.executable, "-c", script])
    with pytest.raises(TimeoutError) as e:
        finish(proc, timeout=3)
    grandchild = int(str(e.value).split("output tail:\n")[1].split()[0])
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the grandchild survived its group's kill"
    assert time.monotonic() - t0 < 20


def test_kill_when_kills_a_ready_child_and_times_out_on_a_stuck_one(tmp_path) -> None:
    marker = tmp_path / "ready"
    proc = kill_when([sys.executable, "-c", f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); "
                      "time.sleep(3600)"], marker.exists, timeout=60)
    assert proc.returncode == -9
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="not ready within 2 s"):
        kill_when([sys.executable, "-c", "import time; time.sleep(3600)"], lambda: False, timeout=2)
    assert time.monotonic() - t0 < 15


def test_run_returns_output_and_code() -> None:
    res = run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
              timeout=30)
    assert (res.returncode, res.stdout, res.stderr) == (3, "out\n", "err\n")


def test_free_ports_are_free_and_distinct() -> None:
    import socket

    a, b = free_port(), free_port()
    for p in (a, b):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    assert a > 0 and b > 0
