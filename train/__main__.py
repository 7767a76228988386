"""Train a head of any registered family (heads.registry): the generic entry over the shared loop (train/loop.py).

    python -m train --config configs/tiny-medusa.yaml --out runs/medusa-tiny       # head.family picks the family
    python train/__main__.py --config C --out D --resume auto                      # the same, as a script path
    accelerate launch --config_file configs/accelerate/ddp.yaml -m train --config C --out D

A family added as a folder `heads/<name>/` trains here with no entry script of its own; train/eagle.py,
train/medusa.py and train/mtp.py are the same loop restricted to their families.
"""

from __future__ import annotations

from train.loop import main

if __name__ == "__main__":
    main()
