"""EAGLE-3's draft vocabulary, and the head tensors that come from data and the target (`prepare`).

Draft vocabulary: the N most frequent tokens among loss-masked training tokens (ties: lower id first), sorted
by id; `d2t[i] = id_i - i`, `t2d[id] = True` for chosen ids (vLLM/SGLang convention).

Tests: `.venv/bin/python -m pytest -q tests/test_eagle.py -k vocab`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from heads.base import HeadConfig
from heads.eagle.config import resolved_draft_vocab
from heads.types import TargetIO


def draft_vocab_from_counts(counts: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the n most frequent ids of `counts` (ties: lower id first), draft ids sorted by target id.

    Worked example: counts [5, 0, 9, 9, 1], n = 3 -> chosen ids [0, 2, 3], d2t [0, 1, 1], t2d [T F T T F].
    Refuses n larger than the number of ids seen at least once.
    """
    seen = int((counts > 0).sum())
    if n > seen:
        raise ValueError(
            f"head.draft_vocab_size {n} is larger than the {seen} distinct tokens in the loss-masked "
            f"training data; set head.draft_vocab_size <= {seen} or train on more data"
        )
    order = np.argsort(-counts, kind="stable")[:n]
    ids = torch.as_tensor(np.sort(order), dtype=torch.long)
    d2t = ids - torch.arange(n)
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def token_counts(dataset: Any, vocab_size: int) -> np.ndarray:
    """How often each target id appears at loss-masked positions of a tokenized dataset."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(dataset), 1024):
        rows = dataset[start : start + 1024]
        ids = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows["input_ids"]])
        mask = np.concatenate([np.asarray(r, dtype=bool) for r in rows["loss_mask"]])
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def prepare(cfg: HeadConfig, dataset: Any, target: TargetIO) -> dict[str, torch.Tensor]:
    """Initial values for head tensors that come from data and the target (the loop loads them after build).

    EAGLE-3: `d2t`/`t2d` from the loss-masked training tokens, and `lm_head.weight` initialised from the
    target's lm_head rows of the draft vocab with the target's final-norm scale folded in (so that with
    norm.weight = 1 the draft's logits start as the target's own on the same hidden state).
    EAGLE-1 has nothing data-derived.
    """
    if cfg.family != "eagle3":
        return {}
    n = resolved_draft_vocab(cfg, target.vocab_size)
    d2t, t2d = draft_vocab_from_counts(token_counts(dataset, target.vocab_size), n)
    out = {"d2t": d2t, "t2d": t2d}
    weight = getattr(target.lm_head, "weight", None)
    if weight is not None and tuple(weight.shape) == (target.vocab_size, target.hidden_size):
        rows = weight.detach().float().cpu()[torch.arange(n) + d2t]
        scale = final_norm_scale(target)
        out["lm_head.weight"] = rows if scale is None else rows * scale[None, :]
    return out


def final_norm_scale(target: TargetIO) -> torch.Tensor | None:
    """The target's final-norm scale per hidden unit [H] (its output on an all-ones input, whose RMS is 1;
    covers a plain `w` and Gemma's `1 + w` alike), or None for a norm with a bias or no norm."""
    if target.norm is None or getattr(target.norm, "bias", None) is not None:
        return None
    with torch.no_grad():
        p = next(target.norm.parameters(), None)
        ones = torch.ones(1, target.hidden_size, dtype=p.dtype if p is not None else torch.float32,
                          device=p.device if p is not None else "cpu")
        return target.norm(ones).float().cpu().reshape(-1)
