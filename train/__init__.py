"""Training: the one shared loop (`train.loop`) and thin per-family entry scripts (`train/eagle.py`, ...)."""
