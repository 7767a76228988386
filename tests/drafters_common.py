"""Shared helpers for the drafter tests: feature batches, one-batch overfitting, model.generate's greedy
reference, the exact law of plain sampling vs speculative counts, chi-square and its power.

Imported by the drafter, decoder-loop and exactness test modules (not a test module itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from data.features import forward_features, greedy_ids
from eval.decoder import speculative_generate, target_distribution


def exact_law(model, prompt: list[int], n_new: int, temperature: float = 1.0, top_k: int = 0,
              top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """Exact P(the first n_new new tokens) of plain sampling, enumerated over the outcomes the processed
    target can produce (target_distribution: transformers' warpers, the processor both decoders use)."""
    exact: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == len(prompt) + n_new:
            exact[tuple(prefix[len(prompt):])] = prob
            return
        with torch.no_grad():
            p = target_distribution(model(torch.tensor([prefix])).logits[0, -1], temperature, top_k, top_p)
        for t in torch.nonzero(p).flatten().tolist():
            walk(prefix + [t], prob * float(p[t]))

    walk(list(prompt), 1.0)
    return exact


def exact_and_empirical(model, prompt: list[int], make_drafter, k: int, n_new: int, top_k: int, samples: int,
                        temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int | None = None,
                        cache: str = "dynamic", make_policy=None):
    """Exact law of the first n_new tokens (`exact_law`) and counts of them from speculative sampling.

    Each speculative sample runs with its own seeded generators (make_drafter(i) seeds the drafter's).
    max_new_tokens (default n_new) may be larger, so that the passes producing the compared tokens can draft
    deeper (the decoder never drafts past max_new_tokens). make_policy(i): an eval.decoder.DraftPolicy for
    sample i (None: the fixed draft length k).
    """
    exact = exact_law(model, prompt, n_new, temperature, top_k, top_p)
    counts: dict[tuple[int, ...], int] = {}
    for i in range(samples):
        out, _ = speculative_generate(model, torch.tensor([prompt]), make_drafter(i), k=k,
                                      max_new_tokens=max_new_tokens or n_new, temperature=temperature,
                                      top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(i),
                                      cache=cache, policy=None if make_policy is None else make_policy(i))
        key = tuple(out[:n_new].tolist())
        counts[key] = counts.get(key, 0) + 1
    return exact, counts


def chi_square(exact: dict, counts: dict, n: int) -> tuple[float, int]:
    """Pearson's chi-square statistic of counts against n * exact and its degrees of freedom, cells with
    expected count < 5 pooled into one."""
    assert set(counts) <= set(exact), "an outcome plain sampling can never produce"
    big = [c for c in exact if exact[c] * n >= 5]
    small = [c for c in exact if exact[c] * n < 5]
    cells = [(n * exact[c], counts.get(c, 0)) for c in big]
    if small:
        cells.append((n * sum(exact[c] for c in small), sum(counts.get(c, 0) for c in small)))
    return sum((o - e) ** 2 / e for e, o in cells), len(cells) - 1


def chi_square_pvalue(exact: dict, counts: dict, n: int) -> float:
    """P(chi-square(df) >= the statistic): the test's p-value (see `chi_square`)."""
    stat, df = chi_square(exact, counts, n)
    return float(1 - torch.special.gammainc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square_critical(df: int, alpha: float) -> float:
    """The level-alpha critical value of chi-square(df) (bisection on its survival function)."""
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        sf = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(mid / 2, dtype=torch.float64)))
        lo, hi = (mid, hi) if sf > alpha else (lo, mid)
    return hi


def chi_square_power(stat: float, df: int, alpha: float, draws: int = 200_000, seed: int = 0) -> float:
    """Estimated power at level alpha against the alternative that produced `stat` (used to document tests).

    Plug-in noncentrality lambda = max(stat - df, 0) (E[stat] = df + lambda under the alternative); the power
    P(chi-square(df, lambda) > critical value) is simulated: a noncentral chi-square(df, lambda) is a
    central chi-square with df + 2J degrees of freedom, J ~ Poisson(lambda / 2).
    """
    crit = chi_square_critical(df, alpha)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        j = torch.poisson(torch.full((draws,), max(stat - df, 0.0) / 2, dtype=torch.float64))
        x = 2 * torch.distributions.Gamma(df / 2 + j, torch.ones_like(j)).sample()
    return float((x > crit).double().mean())


def hf_greedy(model, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, object]:
    """(model.generate's greedy continuation of ids [1, T], up to n tokens; the eos id(s) it stops at).

    transformers' own loop is the ground truth of identity tests (our plain loop is checked against it too);
    pass the eos to speculative_generate so both stop at the same token.
    """
    eos = model.generation_config.eos_token_id
    out = model.generate(ids, do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, ids.shape[1]:], eos


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
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "last": feats.last,
            "target_argmax": greedy_ids(model, feats.last).long()}


def sampling_pvalue(model, prompt: list[int], make_drafter, samples: int = 600, make_policy=None, **kw) -> float:
    """Chi-square p-value of speculative sampling (temperature 1, top-3, k 2, 4 new tokens; **kw overrides)
    against plain sampling's law."""
    exact, counts = exact_and_empirical(model, prompt, make_drafter, **{"k": 2, "n_new": 4, "top_k": 3, **kw},
                                        samples=samples, make_policy=make_policy)
    return chi_square_pvalue(exact, counts, samples)


def assert_sampling_exact(model, prompt: list[int], make_drafter, samples: int = 600, make_policy=None,
                          **kw) -> None:
    """Speculative sampling (temperature 1, top-3, k 2, 4 new tokens; **kw overrides) follows plain sampling's law.

    Fixed seeds make it deterministic; a drafter whose q did not match its drafts, or a verifier that
    resampled from p after a rejection, fails it (chi-square p-value far below 1e-3).
    """
    pv = sampling_pvalue(model, prompt, make_drafter, samples, make_policy, **kw)
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
