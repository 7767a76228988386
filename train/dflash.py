"""Train a DFlash block drafter: the thin entry script over the shared loop (train/loop.py).

    python train/dflash.py --config configs/tiny-dflash.yaml --out runs/tiny-dflash       # < 1 minute on CPU
    python train/dflash.py --config configs/smollm2-135m-dflash.yaml --out runs/quickstart/dflash \
        --data.path=runs/quickstart/regenerated.jsonl --features.store=$PWD/runs/quickstart/features
        # EAGLE-3's offline store, read only (relative store paths go under --out)
    python train/dflash.py --config C --out D --resume auto                            # continue after preemption

Refuses a config whose head.family is not dflash.
"""

from __future__ import annotations

from train.loop import main

if __name__ == "__main__":
    main(family=("dflash",))
