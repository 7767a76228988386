"""Subprocesses for tests that can never hang the suite (imported by test modules; not a test module itself).

    from procs import start, finish, communicate, run, free_port, kill_when
    proc = start([sys.executable, "train/eagle.py", ...], cwd=ROOT, env=env)   # its own process group
    rc, out = finish(proc, timeout=300)            # on timeout: the WHOLE group is killed, output so far returned
    res = run([...], timeout=60)                   # start + finish; a CompletedProcess (stdout, stderr)

Why a group: `accelerate launch` (and shell scripts) start children; killing only the direct child on a
timeout leaves them running, and a child that inherited the stdout pipe keeps `communicate()` waiting
forever. Every process here starts in a new session (start_new_session=True) and a timeout kills the whole
group with SIGKILL, and every descendant too (torch's elastic agent starts each worker in a session of
its own), then stops reading the pipes after a short grace period even if something escaped. `finish` raises TimeoutError (naming the command and the output tail) after cleaning up.
`free_port()` gives a free TCP port for a rendezvous, so concurrent test runs do not collide.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

GRACE_S = 10.0  # after killing the group: how long to wait for the pipes to close


def start(cmd: Sequence[str], *, merge_stderr: bool = True, capture: bool = True, **kwargs: Any) -> subprocess.Popen:
    """Popen in a new session (its own process group), text mode; stderr merged into stdout by default."""
    if capture:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    else:
        kwargs.setdefault("stdout", subprocess.DEVNULL)
        kwargs.setdefault("stderr", subprocess.DEVNULL)
    return subprocess.Popen(list(cmd), start_new_session=True, text=True, **kwargs)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of pid, from /proc (children that started sessions of their own included)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL proc's process group (its pid: start() made a new session) and every descendant: torch's
    elastic launcher starts its workers in sessions of their own, out of reach of the group kill."""
    descendants = _descendants(proc.pid)
    for kill, target in [(os.killpg, proc.pid)] + [(os.kill, d) for d in descendants]:
        try:
            kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _drain(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=GRACE_S)
    except subprocess.TimeoutExpired:  # something outside the group still holds a pipe: stop reading
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait(timeout=GRACE_S)
        out, err = "", ""
    return out or "", err or ""


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for proc; (returncode, its output). On timeout kill its group and raise TimeoutError with the tail."""
    out, err = communicate(proc, timeout)
    return proc.returncode, out + err


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of proc; on timeout its group is killed and TimeoutError names the command."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = _drain(proc)
        raise TimeoutError(f"{' '.join(map(str, proc.args))[:200]} did not finish in {timeout:.0f} s; its process "
                           f"group was killed; output tail:\n{(out + err)[-3000:]}") from None
    return out or "", err or ""


def run(cmd: Sequence[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """Like subprocess.run(capture_output=True, text=True), in its own process group, killed whole on timeout."""
    proc = start(cmd, merge_stderr=False, **kwargs)
    out, err = communicate(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_when(cmd: Sequence[str], ready: Callable[[], bool], timeout: float, **kwargs: Any) -> subprocess.Popen:
    """Start cmd (its own group, output discarded), wait until ready() or until it ends by itself, then SIGKILL
    its whole group (a crash-at-any-moment test). Returns the ended process: returncode -SIGKILL when the kill
    landed. Raises TimeoutError when neither happened within `timeout`; the group is killed either way."""
    proc = start(cmd, capture=False, **kwargs)
    try:
        deadline = time.time() + timeout
        while not ready() and proc.poll() is None:
            if time.time() > deadline:
                raise TimeoutError(f"{' '.join(map(str, cmd))[:200]}: not ready within {timeout:.0f} s")
            time.sleep(0.005)
    finally:
        kill_group(proc)
        proc.wait()
    return proc


def free_port() -> int:
    """A TCP port free right now (bind to port 0 and read what the kernel chose)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
