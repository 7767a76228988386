"""Shared helpers for the drafter tests: feature batches, one-batch overfitting, exact law of plain sampling vs speculative counts.

Imported by tests/test_medusa.py and tests/test_mtp.py (not a test module itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from data.features import forward_features
from eval.decoder import speculative_generate, target_distribution


def exact_and_empirical(model, prompt: list[int], make_drafter, k: int, n_new: int, top_k: int, samples: int,
                        make_policy=None):
    """Exact P(new tokens) of plain sampling (temperature 1, top-k) and counts from speculative sampling.

    With top-k the target has top_k**n_new outcomes, enumerated exactly with target_distribution (the
    processor both decoders use); each speculative sample runs with its own seeded generators.
    make_policy(i): an eval.decoder.DraftPolicy for sample i (None: the fixed draft length k).
    """
    exact: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == len(prompt) + n_new:
            exact[tuple(prefix[len(prompt):])] = prob
            return
        with torch.no_grad():
            p = target_distribution(model(torch.tensor([prefix])).logits[0, -1], 1.0, top_k)
        for t in torch.nonzero(p).flatten().tolist():
            walk(prefix + [t], prob * float(p[t]))

    walk(list(prompt), 1.0)
    counts: dict[tuple[int, ...], int] = {}
    for i in range(samples):
        out, _ = speculative_generate(model, torch.tensor([prompt]), make_drafter(i), k=k, max_new_tokens=n_new,
                                      temperature=1.0, top_k=top_k, generator=torch.Generator().manual_seed(i),
                                      policy=None if make_policy is None else make_policy(i))
        counts[tuple(out.tolist())] = counts.get(tuple(out.tolist()), 0) + 1
    return exact, counts


def chi_square_pvalue(exact: dict, counts: dict, n: int) -> float:
    """Pearson's chi-square of counts against n * exact, cells with expected < 5 pooled into one."""
    assert set(counts) <= set(exact), "an outcome plain sampling can never produce"
    big = [c for c in exact if exact[c] * n >= 5]
    small = [c for c in exact if exact[c] * n < 5]
    cells = [(n * exact[c], counts.get(c, 0)) for c in big]
    if small:
        cells.append((n * sum(exact[c] for c in small), sum(counts.get(c, 0) for c in small)))
    stat = sum((o - e) ** 2 / e for e, o in cells)
    df = len(cells) - 1
    return float(1 - torch.special.gammainc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def make_batch(model, seqs: list[list[int]], prompt_len: int = 4) -> dict[str, torch.Tensor]:
    """Right-padded batch of `seqs` with features; tokens from `prompt_len` on are loss-masked in."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
    loss_mask = attn.clone()
    loss_mask[:, :prompt_len] = 0
    feats, _ = forward_features(model, ids, attn)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "last": feats.last}


def sampling_pvalue(model, prompt: list[int], make_drafter, samples: int = 600, make_policy=None) -> float:
    """Chi-square p-value of speculative sampling (temperature 1, top-3, k 2, 4 new tokens) against plain's law."""
    exact, counts = exact_and_empirical(model, prompt, make_drafter, k=2, n_new=4, top_k=3, samples=samples,
                                        make_policy=make_policy)
    return chi_square_pvalue(exact, counts, samples)


def assert_sampling_exact(model, prompt: list[int], make_drafter, samples: int = 600, make_policy=None) -> None:
    """Speculative sampling (temperature 1, top-3, k 2, 4 new tokens) must follow plain sampling's law.

    Fixed seeds make it deterministic; a drafter whose q did not match its drafts, or a verifier that
    resampled from p after a rejection, fails it (chi-square p-value far below 1e-3).
    """
    pv = sampling_pvalue(model, prompt, make_drafter, samples, make_policy)
    assert pv > 1e-3, f"chi-square p = {pv:.2e}"


def overfit(loss_fn: Callable, head, batch, target, steps: int, lr: float = 1e-2) -> tuple[list[float], dict]:
    """Adam on one batch with a family's loss: (losses per step, metrics of the last step)."""
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    losses, metrics = [], {}
    for _ in range(steps):
        loss, metrics = loss_fn(head, batch, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, metrics
