"""A toy fifth head family, written whole into one folder: tests/test_registry.py copies this file to
`heads/toy/__init__.py` (and TINY_YAML to `heads/toy/tiny.yaml`) in a temporary copy of the repository, then
trains, evaluates and exports it there with no other edit. Not imported by the project itself.

The head is one linear layer on the target's last hidden state at position t (what the target's own lm_head
reads to predict token t+1), trained with cross-entropy to predict token t+2: the token after the root. Its
drafter proposes a chain of one token (Medusa's head 0 without the residual block); native only, so the
family needs no convert/ module and no entry script (`python -m train` trains it).

    .venv/bin/python -m pytest -q tests/test_registry.py
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heads.align import shift_targets
from heads.base import HeadConfig, check_eval_tree
from heads.registry import Family
from heads.types import DraftTree, Features, TargetIO

TINY_YAML = """\
# The toy family on the tiny random Llama target built in-process (no download): tests/test_registry.py.
target:
  name_or_path: tiny-random-llama
  device: cpu
data:
  path: data/bundled/tiny_conversations.jsonl
  max_length: 256
  holdout_fraction: 0.1
features:
  mode: online
head:
  family: toy
optim:
  lr: 1.0e-3
  warmup_steps: 1
train:
  max_steps: 4
  batch_size: 2
  checkpoint_every: 50
  eval_every: 2
  log_every: 1
logging:
  wandb_mode: disabled
eval:
  bench: [mt_bench]
  max_questions: 1
  max_new_tokens: 8
"""


@dataclass
class ToyConfig(HeadConfig):
    family: str = "toy"


class ToyHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, last: torch.Tensor) -> torch.Tensor:
        return self.proj(last.to(self.proj.weight.dtype))


def feature_layers(cfg: ToyConfig, target_config: Any) -> list[int]:
    return []  # `last` only


def build(cfg: ToyConfig, target: TargetIO) -> ToyHead:
    """Starts as the target's own lm_head (a copy, trained apart): it drafts the root again, which a random
    tiny target's repetitive greedy text often accepts, so the decoder's accept path is exercised too."""
    head = ToyHead(target.hidden_size, target.vocab_size)
    head.proj.weight.data.copy_(target.lm_head.weight.detach().float())
    return head.to(target.lm_head.weight.device)


def loss(head: nn.Module, batch: dict[str, torch.Tensor], target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    labels, mask = shift_targets(batch["input_ids"], valid, 2)
    if not mask.any():
        return batch["last"].new_zeros((), dtype=torch.float32), {"top1/0": 0.0, "n/0": 0.0}
    logits, gold = head(batch["last"][mask]).float(), labels[mask]
    return F.cross_entropy(logits, gold), {"top1/0": float((logits.argmax(-1) == gold).float().mean()),
                                           "n/0": float(gold.numel())}


class ToyDrafter:
    """One drafted token per pass, from the hidden state that produced the root."""

    capture_layers: tuple[int, ...] | None = ()

    def __init__(self, head: ToyHead, target: TargetIO):
        self.head, self.target = head, target
        self.last: torch.Tensor | None = None

    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self.last = features.last[0, -1]

    @torch.no_grad()
    def draft(self, k: int, temperature: float) -> DraftTree:
        tokens = self.head(self.last).argmax(-1).reshape(1)[:k]  # deterministic: q is one-hot on the token
        return DraftTree.chain(tokens)

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens(accepted, features, next_token)

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        self.last = features.last[0, -1]  # the last accepted node's (or the old root's) hidden state


def drafter_factory(head: ToyHead, target: TargetIO, tree: str = "auto", k: int = 4) -> Callable[[], ToyDrafter]:
    check_eval_tree(tree, "toy", ("chain",))
    return lambda: ToyDrafter(head, target)


FAMILIES = (Family(name="toy", config=ToyConfig, feature_layers=feature_layers, build=build, loss=loss,
                   drafter_factory=drafter_factory, trees=("chain",), tiny="heads/toy/tiny.yaml"),)
