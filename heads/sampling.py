"""The one draft sampler: how every drafter turns its logits into a token (and the q the exact rule needs).

    from heads.sampling import draft_token, draft_distribution, sample_token, uniform
    tok, q = draft_token(logits, temperature, generator)   # argmax and None when greedy, else a draw from q
    q = draft_distribution(logits, temperature)             # softmax(logits / T) in float32 (tree drafters)

Every drafter (EAGLE, Medusa and MTP heads here, the draft models of eval.drafters) draws through these, so a
draft's q is exactly the distribution its token came from, whatever the drafter. The draw itself
(`sample_token`: one uniform, CDF inversion) is also the target side's (data.sampling re-exports it): it
lives here because heads/ sits below data/ in the layering and cannot import it.
"""

from __future__ import annotations

import torch

__all__ = ["draft_distribution", "draft_token", "sample_token", "uniform"]


def uniform(generator: torch.Generator | None, device: torch.device | str) -> float:
    """One U[0, 1) draw from `generator` on the generator's own device (or `device` without one).

    Generators live on a device: a CPU generator cannot draw a CUDA tensor and vice versa, so the draw happens
    where the generator is and only the Python float comes back.
    """
    where = generator.device if generator is not None else device
    return float(torch.rand((), generator=generator, device=where))


def sample_token(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from p [V] (non-negative, any positive sum) by inverting its CDF with a single uniform.

    Same distribution as torch.multinomial(p, 1), at a fraction of its per-call cost on a CPU. Zero-probability
    tokens are never returned: searchsorted(right=True) skips flat steps of the cumulative sum.
    """
    c = torch.cumsum(p, dim=0)
    u = torch.tensor(uniform(generator, p.device), dtype=c.dtype, device=c.device) * c[-1]
    i = int(torch.searchsorted(c, u, right=True))
    # u < c[-1] in exact arithmetic; rounding can land on it, so fall back to the last possible token.
    return i if i < c.numel() else int(torch.nonzero(p)[-1])


def draft_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A draft's q over the last dim of logits [..., V]: softmax(logits / temperature) in float32 (temperature > 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def draft_token(logits: torch.Tensor, temperature: float,
                generator: torch.Generator | None = None) -> tuple[int, torch.Tensor | None]:
    """The drafted token after one logits row [V], and the q it was drawn from.

    Greedy (temperature <= 0): (argmax, None). Otherwise a draw from q = draft_distribution(logits, T) with
    the drafter's own `generator` (any device), and q for the acceptance rule min(1, p/q).
    """
    if temperature <= 0:
        return int(logits.argmax()), None
    q = draft_distribution(logits, temperature)
    return sample_token(q, generator), q
