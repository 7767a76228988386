"""Run a module and SIGKILL it, with every process it started, right after the N-th time it made one file
durable: an fsync of that file, or a rename onto it (used by tests/test_vllm.py; not a test module itself).

    python tests/crash_at.py regenerated.jsonl 1 -m data.regenerate --out D ...            # after chunk 1's fsync
    python tests/crash_at.py <split>/part-r0000of0001.json 2 -m data.extract --out D ...   # after shard 1's record

FILE is a path suffix ("<split>/part-r0000of0001.json" matches that file in any folder named <split>).
Why not poll from the test and kill: vLLM's CPU workers spin on both cores, and a test process polling the
output file every 5 ms was starved (twice in CI: every answer was on disk before the kill landed). `nice` does
not help, because the run starts a session of its own and the kernel's autogroup scheduling shares the CPU
between sessions, niceness counting only inside one. Killing from inside the run lands at an exact point.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import _descendants  # noqa: E402  (tests/ is this script's own folder, first on sys.path)


def main() -> None:
    suffix, after, *rest = sys.argv[1:]
    if rest[:1] != ["-m"] or len(rest) < 2:
        raise SystemExit("usage: crash_at.py FILE N -m MODULE [ARGS...]")
    want, seen = Path(suffix).parts, [0]

    def durable(path: str | os.PathLike) -> None:
        if Path(os.path.abspath(path)).parts[-len(want):] == want:
            seen[0] += 1
            if seen[0] == int(after):
                # vLLM's engine processes first, wherever their session is, then this process (not its group:
                # run by hand, that would be the caller's shell)
                for pid in [*_descendants(os.getpid()), os.getpid()]:
                    os.kill(pid, signal.SIGKILL)

    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        durable(os.readlink(f"/proc/self/fd/{fd}"))

    def replace(src, dst, *args, **kwargs) -> None:  # pathlib's Path.replace calls os.replace too
        real_replace(src, dst, *args, **kwargs)
        durable(dst)

    os.fsync, os.replace = fsync, replace
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
