"""Train Medusa heads: the thin entry script over the shared loop (train/loop.py).

    python train/medusa.py --config configs/tiny-medusa.yaml --out runs/medusa-tiny          # < 1 minute on CPU
    python train/medusa.py --config configs/smollm2-135m-medusa.yaml --out runs/smol-medusa
    python train/medusa.py --config C --out D --head.num_heads=3 --head.distill=true          # dotted overrides
    python train/medusa.py --config C --out D --resume auto                                 # continue a stopped run

Leaves the head folder in OUT/head (heads.base.load_head). Refuses a config whose head.family is not medusa:
this script trains the families whose `script` is its own name ("medusa") in heads.registry. `python -m train`
(train/__main__.py) trains any family.
"""

from __future__ import annotations

from pathlib import Path

from heads import registry
from train.loop import main

if __name__ == "__main__":
    main(family=registry.trained_by(Path(__file__).stem))
