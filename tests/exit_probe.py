"""Run a training entry script (train/ENTRY), then say whether its process groups really ended (used by
tests/test_distributed.py; not a test module itself).

    accelerate launch --config_file configs/accelerate/ddp.yaml tests/exit_probe.py eagle.py --config C --out D

Every rank prints `exit probe: rank R, gloo threads before teardown N, after the run [names] (waited S s)`.
A process group that outlives train.launch.teardown still has its gloo threads running at interpreter
shutdown, where they now and then abort a finished run (SIGABRT); after the run the list must be empty. The count
before teardown shows the threads are recognised at all (a torch that renamed them would otherwise make
the empty list meaningless).

A CI run once caught rank 1's `gloo_tcp_loop` (gloo's TCP event loop; its process-group workers had ended)
still running right after a 2-machine run that had ended cleanly, exit 0; 18 reruns here did not repeat it,
and why that thread was late is not known. So the probe waits up to SETTLE_S for the threads to end,
collecting garbage as it waits, and the line says how long that took: a thread that only ends a moment
late passes, a group that really outlives the run is still there after the wait.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import train.loop  # noqa: E402  (after the repo root is importable)

SETTLE_S = 5.0


def gloo_threads() -> list[str]:
    """Names of this process's threads that gloo (torch's CPU process-group backend) started."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:
            continue  # the thread ended meanwhile
    return sorted(n for n in names if "gloo" in n)


def settled_gloo_threads() -> tuple[list[str], float]:
    """The gloo threads still running once none is left or SETTLE_S has passed, and the seconds waited."""
    start = time.monotonic()
    left = gloo_threads()
    while left and time.monotonic() - start < SETTLE_S:
        gc.collect()
        time.sleep(0.1)
        left = gloo_threads()
    return left, time.monotonic() - start


def main() -> None:
    teardown = train.loop.teardown
    before: list[int] = []

    def counting_teardown(accelerator: Any) -> None:
        before.append(len(gloo_threads()))
        teardown(accelerator)

    train.loop.teardown = counting_teardown
    script = REPO / "train" / sys.argv.pop(1)
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")
    after, waited = settled_gloo_threads()
    # one write of the whole line: print() writes the text and its newline separately, so two ranks sharing a
    # pipe could interleave into "...[]exit probe: rank 1..." (a short write to a pipe is atomic)
    sys.stdout.write(f"exit probe: rank {os.environ.get('RANK', '0')}, gloo threads before teardown {before[0]}, "
                     f"after the run {after} (waited {waited:.1f} s)\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
