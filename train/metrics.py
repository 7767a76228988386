"""Training metrics: batch sums reduced over ranks, the simulated acceptance length, and the run's log.

    sums = MetricSum(); sums.add(loss, metrics); means = sums.reduce(accelerator)
    log = MetricsLog(cfg, out, enabled=accelerator.is_main_process); log.write({"event": "eval", ...})

Held-out evaluation reports the mean loss, per-step top-1 `top1/k` (summed over positions: a family's
`n/k` metric weights its batch) and the simulated acceptance length
    tau_sim = 1 + sum_{k=0}^{K-1} prod_{j=0}^{k} top1_j
i.e. tokens per target pass (counting the bonus/correction token) of a greedy chain of K drafts if step j
were accepted independently with probability top1_j; K = the draft steps the family reports. Families that
report `chain/k` (heads.losses.chain_metrics: the share of start positions whose steps 0..k all hit, weighted
by `n/chain`) also get
    tau_chain = 1 + sum_{k=0}^{K-1} chain_k
the same chain's acceptance length measured position by position, without the independence: hits cluster (a
step after a hit hits more often than its average), so on the quickstart's store tau_chain reads about 0.06 above
tau_sim for EAGLE-3 and the block drafter alike.
MetricsLog writes OUT/metrics.jsonl (strict JSON: NaN/inf become null) and wandb on rank 0 only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data.config import RunConfig, to_dict
from data.files import append_line


def step_keys(metrics: dict[str, float]) -> list[int]:
    return sorted(int(k.split("/")[1]) for k in metrics if k.startswith("top1/") and k.split("/")[1].isdigit())


def simulated_tau(top1: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} top1_j: tokens per target pass of a greedy chain (see the module docstring)."""
    tau, run = 1.0, 1.0
    for a in top1:
        run *= a
        tau += run
    return tau


class MetricSum:
    """Sums of batch metrics: losses per batch, `top1/k` weighted by `n/k` (1 when a family gives none)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, loss: float, metrics: dict[str, float], weight: float = 1.0) -> None:
        self.sums["loss"] += weight * loss
        self.sums["batches"] += weight
        for k, v in metrics.items():
            if k.startswith(("n/", "top1/", "chain/")):
                continue
            self.sums[k] += weight * float(v)
        for s in step_keys(metrics):
            n = float(metrics.get(f"n/{s}", 1.0)) * weight
            self.sums[f"top1/{s}"] += float(metrics[f"top1/{s}"]) * n
            self.sums[f"n/{s}"] += n
        chain = [k for k in metrics if k.startswith("chain/")]
        if chain:
            n = float(metrics["n/chain"]) * weight
            for k in chain:
                self.sums[k] += float(metrics[k]) * n
            self.sums["n/chain"] += n

    def reduce(self, accelerator: Any) -> dict[str, float]:
        """Sum over ranks (every rank holds the same keys), then turn sums into means."""
        keys = sorted(self.sums)
        vals = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            vals = accelerator.reduce(vals, reduction="sum")
        tot = dict(zip(keys, vals.tolist()))
        batches = max(tot.pop("batches", 0.0), 1e-12)
        out = {k: v / batches for k, v in tot.items() if not k.startswith(("n/", "top1/", "chain/"))}
        top1 = []
        for s in sorted(int(k.split("/")[1]) for k in tot if k.startswith("top1/")):
            out[f"top1/{s}"] = tot[f"top1/{s}"] / max(tot[f"n/{s}"], 1e-12)
            top1.append(out[f"top1/{s}"])
        if top1:
            out["tau_sim"] = simulated_tau(top1)
        chain = sorted(int(k.split("/")[1]) for k in tot if k.startswith("chain/"))
        for s in chain:
            out[f"chain/{s}"] = tot[f"chain/{s}"] / max(tot["n/chain"], 1e-12)
        if chain:
            out["tau_chain"] = 1.0 + sum(out[f"chain/{s}"] for s in chain)
        return out


class TrainWindow:
    """Training metrics and real (unpadded) tokens since the last `train` row of metrics.jsonl."""

    def __init__(self) -> None:
        self.sums, self.tokens, self.t0 = MetricSum(), 0, time.perf_counter()

    def add(self, loss: float, metrics: dict[str, float], tokens: int) -> None:
        self.sums.add(loss, metrics)
        self.tokens += tokens

    def row(self, accelerator: Any) -> dict[str, float]:
        """Means over all ranks, and tokens/s estimated as this rank's tokens x the process count."""
        means = self.sums.reduce(accelerator)
        elapsed = time.perf_counter() - self.t0
        return {"tokens_per_s": self.tokens * accelerator.num_processes / max(elapsed, 1e-9), **means}


def finite_or_none(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf are not JSON: they are written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


class MetricsLog:
    """OUT/metrics.jsonl and wandb on rank 0; nothing on other ranks."""

    def __init__(self, cfg: RunConfig, out: Path, enabled: bool):
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.wandb = None
        if not enabled or cfg.logging.wandb_mode == "disabled":
            return
        mode = cfg.logging.wandb_mode
        netrc = Path("~/.netrc").expanduser()
        if mode == "online" and not os.environ.get("WANDB_API_KEY") and not (
            netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
        ):
            print("wandb: no stored credentials, logging offline instead (wandb sync later)", file=sys.stderr)
            mode = "offline"
        import wandb  # here, not at the top: half a second of import time that runs with wandb disabled skip

        run_id = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
        self.wandb = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.run_name or out.name,
                                id=run_id, resume="allow", mode=mode, dir=str(out), config=to_dict(cfg))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        append_line(self.path, json.dumps(finite_or_none(row), allow_nan=False))  # never through a symlink
        if self.wandb is not None and "step" in row:
            self.wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=int(row["step"]))

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def format_eval(step: int, m: dict[str, float]) -> str:
    steps = [m[f"top1/{s}"] for s in sorted(int(k.split("/")[1]) for k in m if k.startswith("top1/"))]
    top1 = " ".join(f"{a:.3f}" for a in steps)
    chained = f", chained {m['tau_chain']:.3f}" if "tau_chain" in m else ""
    return (f"eval step {step}: held-out loss {m['loss']:.4f} | top-1 per draft step {top1} | "
            f"simulated tau {m.get('tau_sim', float('nan')):.3f}{chained} (tokens per target pass incl. bonus, "
            f"greedy chain of {len(steps)})")
