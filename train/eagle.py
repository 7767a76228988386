"""Train an EAGLE-1 or EAGLE-3 head: the thin entry script over the shared loop (train/loop.py).

    python train/eagle.py --config configs/tiny-eagle.yaml --out runs/tiny            # < 1 minute on CPU
    python train/eagle.py --config configs/smollm2-135m.yaml --out runs/smol --data.path=runs/smol/regenerated.jsonl
    accelerate launch --config_file configs/accelerate/ddp.yaml train/eagle.py --config configs/llama8b.yaml
    python train/eagle.py --config C --out D --resume auto                            # continue after preemption

Refuses a config whose head.family is not eagle1 or eagle3: this script trains the families whose `script`
is its own name ("eagle") in heads.registry. `python -m train` (train/__main__.py) trains any family.
"""

from __future__ import annotations

from pathlib import Path

from heads import registry
from train.loop import main

if __name__ == "__main__":
    main(family=registry.trained_by(Path(__file__).stem))
