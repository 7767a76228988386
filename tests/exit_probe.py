"""Run a training entry script (train/ENTRY), then say whether its process groups really ended (used by
tests/test_distributed.py; not a test module itself).

    accelerate launch --config_file configs/accelerate/ddp.yaml tests/exit_probe.py eagle.py --config C --out D

Every rank prints `exit probe: rank R, gloo threads before teardown N, after the run [names]`. A process
group that outlives train.launch.teardown still has its gloo threads running at interpreter shutdown,
where they now and then abort a finished run (SIGABRT); after the run the list must be empty. The count
before teardown shows the threads are recognised at all (a torch that renamed them would otherwise make
the empty list meaningless).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import train.loop  # noqa: E402  (after the repo root is importable)


def gloo_threads() -> list[str]:
    """Names of this process's threads that gloo (torch's CPU process-group backend) started."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:
            continue  # the thread ended meanwhile
    return sorted(n for n in names if "gloo" in n)


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
    # one write of the whole line: print() writes the text and its newline separately, so two ranks sharing a
    # pipe could interleave into "...[]exit probe: rank 1..." (a short write to a pipe is atomic)
    sys.stdout.write(f"exit probe: rank {os.environ.get('RANK', '0')}, gloo threads before teardown {before[0]}, "
                     f"after the run {gloo_threads()}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
