"""The one sampler of the project: transformers' own logits processors, then a single-uniform draw.

Plain decoding (`eval.decoder.plain_generate`), speculative verification (`eval.decoder.speculative_generate`)
and response regeneration (`data.regenerate`) all shape the target's distribution with `target_distribution`,
which runs the SAME warpers `model.generate(do_sample=True, ...)` builds, in its order (temperature, top-k,
top-p, min-p), so "exact" means exact against `model.generate`, not against a private re-implementation.

    from data.sampling import target_distribution, sample_token
    p = target_distribution(logits, temperature=0.7, top_k=50, top_p=0.9)   # [..., V], rows sum to 1
    tok = sample_token(p[-1], generator)                                      # heads.sampling's draw
    gen = torch.Generator().manual_seed(turn_seed(run_seed, prompt_id, turn))   # one answer's own seed
"""

from __future__ import annotations

import hashlib

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# The one draw (a single uniform, CDF inversion) is the drafters' too, so it lives in heads/ (below data/).
from heads.sampling import sample_token, uniform

__all__ = ["sample_token", "target_distribution", "turn_seed", "uniform", "warpers"]


def turn_seed(seed: int, *key: object) -> int:
    """The sampling seed of one answer: a hash of (run seed, *key), e.g. (seed, prompt id, turn).

    Stable across processes (Python's hash() of strings is salted per process) and independent of batching,
    so an answer does not depend on its batch neighbours or on an interruption. Regeneration's derivation
    (sha256 of "seed/id/turn", the first 8 bytes little-endian, 63 bits): its outputs depend on it.
    """
    digest = hashlib.sha256("/".join(str(x) for x in (seed, *key)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def warpers(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> LogitsProcessorList:
    """transformers' sampling warpers for these settings, in `model.generate`'s order (the no-op ones left out).

    top_k 0, top_p 1 and min_p 0 are off. Raises ValueError on a temperature <= 0 (greedy is an argmax, not
    a distribution) or a top_p / min_p outside its range.
    """
    if temperature <= 0:
        raise ValueError(f"target_distribution: temperature must be > 0 (got {temperature}); greedy uses argmax")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"target_distribution: top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"target_distribution: min_p must be in [0, 1], got {min_p}")
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        procs.append(MinPLogitsWarper(min_p))
    return procs


def target_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                        min_p: float = 0.0) -> torch.Tensor:
    """softmax(warpers(logits)) over the last dim of logits [..., V], in float32, as `model.generate` samples.

    Example: probabilities [.5, .25, .125, .125] with top_p 0.75 keep the first two tokens ([2/3, 1/3, 0, 0]):
    TopPLogitsWarper drops a token when the mass of the tokens ranked BELOW it (it included) is <= 1 - top_p.
    """
    procs = warpers(temperature, top_k, top_p, min_p)
    # generate warps float32 scores of shape [batch, V]; the warpers scatter along dim 1.
    x = logits.float().reshape(-1, logits.shape[-1])
    x = procs(None, x) if len(procs) else x
    return torch.softmax(x, dim=-1).reshape(logits.shape)
