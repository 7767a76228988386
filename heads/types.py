"""The types every layer shares with the heads: target features, the frozen target pieces, draft trees, the
drafter protocol, and the one target identity record.

    Features(last, aux)        target hidden states for a batch (see the feature convention below)
    TargetIO(config, embed, lm_head, ...)   the frozen target parts a head trains and drafts with
    DraftTree(tokens, parents, probs, sampling, sources)   what a drafter proposes to the decoder
    Drafter                    the protocol the speculative decoder (eval.decoder) drives
    target_record(config, embed_weight, name) / TargetIO.record()   the target identity every head folder,
                               store manifest and checkpoint records (heads.base.check_target compares them)

Feature convention (shared with data.features, the store and the decoder): `aux` is the concatenation, in
ascending order, of transformers' `hidden_states[i]` for the requested indices i (index 0 is the embedding
output, index i the INPUT of decoder layer i = the output of layer i-1); `last` is the target's final
hidden state after its final norm (what the target's lm_head reads).

This module imports nothing from the project; `heads.base` re-exports every name (`from heads.base import
Features` keeps working). Tests: `.venv/bin/python -m pytest -q tests/test_heads.py`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


# ----------------------------------------------------------------------------------------------- features
@dataclass
class Features:
    """Target features for a batch: aux [B, T, n*H] (may be None when no layer is asked), last [B, T, H]."""

    last: torch.Tensor
    aux: torch.Tensor | None = None

    def slice(self, start: int, stop: int) -> Features:
        """Positions [start, stop) along the time axis."""
        return Features(
            last=self.last[:, start:stop], aux=None if self.aux is None else self.aux[:, start:stop]
        )

    def index(self, idx: torch.Tensor | slice) -> Features:
        """Positions `idx` (1-D long tensor, in that order; or a slice, a view) along the time axis."""
        return Features(last=self.last[:, idx], aux=None if self.aux is None else self.aux[:, idx])


# ----------------------------------------------------------------------------------------------- target
@dataclass
class TargetIO:
    """The frozen pieces of the target a head trains and drafts with (never saved inside the head)."""

    config: Any  # the target's transformers PretrainedConfig (the text config for multimodal models)
    embed: nn.Module  # token ids -> input embeddings, scaled as the target scales them
    lm_head: nn.Module  # final hidden -> logits over the target vocab
    norm: nn.Module | None = None  # the target's final norm
    last_layer: nn.Module | None = None  # the target's last decoder layer (template for MTP blocks)
    rotary: nn.Module | None = None  # the target's rotary embedding module (cos, sin = rotary(x, pos))
    name: str = ""
    fingerprint: str = ""

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def record(self) -> dict[str, Any]:
        """This target's identity record (see target_record), without re-hashing the weights."""
        return _identity(self.config, self.name, self.fingerprint)


def _identity(config: Any, name: str, fingerprint: str) -> dict[str, Any]:
    """The record's fields, built in this one place for target_record and TargetIO.record."""
    return {"name_or_path": name, "fingerprint": fingerprint, "model_type": getattr(config, "model_type", None),
            "hidden_size": int(config.hidden_size), "num_hidden_layers": int(config.num_hidden_layers),
            "vocab_size": int(config.vocab_size)}


def target_record(config: Any, embed_weight: torch.Tensor, name: str) -> dict[str, Any]:
    """The ONE target identity (TargetInfo) that head folders, store manifests and checkpoints record and
    check_target compares: name, fingerprint of the weights, model type, hidden size, layers, vocab."""
    return _identity(config, name, target_fingerprint(config, embed_weight))


def target_fingerprint(config: Any, embed_weight: torch.Tensor) -> str:
    """A short id of a target: architecture fields plus a checksum of the first embedding rows.

    Cheap to compute (no full weight hash) yet differs between models of the same shape.
    """
    fields = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}
    rows = embed_weight.detach()[:64].float().cpu().contiguous()
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    h.update(rows.numpy().tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------- drafting
@dataclass
class DraftTree:
    """Draft tokens as a tree hanging below the root (the last committed token, not yet seen by the target).

    tokens  [N] long: the drafted token of each node, nodes in topological order (parents first).
    parents [N] long: index of each node's parent node, -1 for children of the root.
    probs   [N, V] float or None: the drafter's distribution q each node was drawn from (the distribution
            at its parent, over the TARGET vocab). None means deterministic drafts (q one-hot on the token).
    sampling: how siblings were drawn when probs is given: "iid" (each child an independent sample of q,
            SpecInfer) or "topk" (distinct top-k children, EAGLE): the verifier treats them differently.
    sources [N] str or None: which proposer each node came from ("head", "ngram", "head+ngram" for a node
            both proposed; eval.drafters.HybridDrafter); None = the drafter itself. Only statistics and
            the decoder's policy read it, never the verifier.
    A chain of k tokens is tokens [k], parents [-1, 0, 1, ..., k-2].
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    sampling: str = "iid"
    sources: list[str] | None = None

    @staticmethod
    def chain(tokens: torch.Tensor, probs: torch.Tensor | None = None) -> DraftTree:
        n = tokens.numel()
        return DraftTree(tokens.reshape(-1), torch.arange(-1, n - 1, device=tokens.device), probs)

    def __len__(self) -> int:
        return int(self.tokens.numel())


class Drafter(Protocol):
    """What the speculative decoder (eval.decoder) asks of any drafter.

    Timeline for one generation (batch 1). Positions are absolute token indices.
      begin(prompt_ids, features, next_token): the target has run over prompt_ids (length n) and
          produced features for positions 0..n-1 (None if capture_layers is None); next_token (position n)
          was sampled from its last distribution and is the root of the first draft.
      draft(k, temperature) -> DraftTree: propose up to k tokens (chain length or tree depth).
      commit(accepted, features, next_token): the target verified the tree; `accepted` are the node
          indices on the accepted path (possibly empty); `features` has len(accepted)+1 positions: the
          root's and each accepted node's, in path order; next_token is the corrected or bonus token,
          the new root. The drafter must roll its own state (caches) back to the accepted path.
      commit_tokens(tokens, features, next_token): the same with the accepted path given by its TOKENS,
          which need not be a path of this drafter's last draft (or there was no draft at all). The
          hybrid drafter (eval.drafters.HybridDrafter) uses it when the accepted path left this drafter's
          own nodes for another proposer's. Every drafter in this project implements it; the decoder alone
          only ever calls commit.
    A drafter whose drafts stop at a fixed depth (DFlash's drafting slots, MTP's separate modules, Medusa's
    tree) also has `max_depth`, that depth: a draft(k) call returns at most that many tokens deep whatever k
    is, and eval.policy prices no deeper. Absent or None: no limit (EAGLE's chains and trees, the n-gram).
    A drafter may also have `nodes(k)`, how many nodes draft(k) returns: eval.policy prices a pass's verify
    rows by it (EAGLE-2's dynamic tree keeps a node budget that is no multiple of its depth); absent, the
    policy learns the nodes per depth from the trees it sees.
    """

    # hidden_states indices the drafter needs from every target pass (`aux`); None = no features at all,
    # () = only `last`.
    capture_layers: tuple[int, ...] | None

    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None: ...

    def draft(self, k: int, temperature: float) -> DraftTree: ...

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None: ...

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None: ...
