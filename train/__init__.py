"""Training: the one shared loop (`train.loop`), its parts (`batches`, `schedule`, `checkpoint`, `signals`,
`metrics`, `launch`, `placement`), the generic entry `python -m train` (`__main__.py`, any registered family)
and thin entry scripts restricted to some families (`train/eagle.py`, ...)."""
