"""Training: the one shared loop (`train.loop`), its parts (`batches`, `schedule`, `checkpoint`, `signals`,
`metrics`, `launch`, `placement`) and thin per-family entry scripts (`train/eagle.py`, ...)."""
