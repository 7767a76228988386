"""Train DeepSeek-V3-style MTP modules: the thin entry script over the shared loop (train/loop.py).

    python train/mtp.py --config configs/tiny-mtp.yaml --out runs/mtp-tiny                  # < 1 minute on CPU
    python train/mtp.py --config configs/smollm2-135m-mtp.yaml --out runs/smol-mtp
    python train/mtp.py --config C --out D --head.recursive=true --head.num_steps=3         # FastMTP-style
    python train/mtp.py --config C --out D --resume auto                                    # continue a stopped run

Leaves the head folder in OUT/head (heads.base.load_head). Refuses a config whose head.family is not mtp:
this script trains the families whose `script` is its own name ("mtp") in heads.registry. `python -m train`
(train/__main__.py) trains any family.
"""

from __future__ import annotations

from pathlib import Path

from heads import registry
from train.loop import main

if __name__ == "__main__":
    main(family=registry.trained_by(Path(__file__).stem))
