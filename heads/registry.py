"""The head family registry: one typed `Family` object per family, found by scanning the `heads` package.

    from heads import registry
    fam = registry.get("medusa")          # ValueError naming the known families on an unknown name
    head = fam.build(cfg, target); loss, metrics = fam.loss(head, batch, target)
    make = fam.drafter_factory(head, target, "chain", 4); drafter = make()
    registry.names()                      # ('eagle1', 'eagle3', 'medusa', 'mtp', ...), sorted

A family lives in one module or sub-package of `heads/` (`heads/medusa.py`, `heads/eagle/`) that declares,
at module level, `FAMILIES: tuple[Family, ...]` (one package may hold several: EAGLE-1 and EAGLE-3 share
`heads/eagle/`). Discovery imports every module and sub-package of `heads` once, on the first question,
and registers what their FAMILIES hold, so dropping a folder `heads/<new>/` is all it takes: train, eval,
data, convert, scripts and tests ask this registry and never list families. `register` adds one by hand
(for code outside `heads/`). The idea is torchtitan's TrainSpec (a frozen record of a model's functions,
looked up by name) with speculators-style discovery of the package's modules.

Tests: `.venv/bin/python -m pytest -q tests/test_registry.py tests/test_heads.py`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heads.base imports this module; the types are only annotations here
    import torch
    from torch import nn

    from heads.base import HeadConfig
    from heads.types import Drafter, TargetIO

# The store key an EAGLE-3-style loss reads beyond the always-present ones (input_ids, attention_mask,
# loss_mask, last, and aux when the family has feature layers): the target's greedy next token.
TARGET_ARGMAX = "target_argmax"


def _reads_nothing_extra(cfg: HeadConfig) -> frozenset[str]:
    return frozenset()


def _labels_are_the_sequence(cfg: HeadConfig) -> bool:
    return False


@dataclass(frozen=True)
class Family:
    """Everything the pipeline needs from a head family. The function fields take the family's own config
    (an instance of `config`):

    name             the `family` key of configs and head folders (== config().family)
    config           its HeadConfig dataclass
    feature_layers   (cfg, target_config) -> the `hidden_states` indices it reads as `aux` ([] for none)
    build            (cfg, target: TargetIO) -> a fresh head holding none of the target's weights
    loss             (head, batch, target) -> (loss, metrics with per-position top-1 `top1/0`, ...)
    drafter_factory  (head, target, tree, k) -> () -> a fresh Drafter; maps eval.tree onto the family's
                     options and raises HeadError for a tree outside `trees`; a family with "dynamic" in
                     `trees` also takes its sizes as keywords `topk` and `tokens` (eval.tree_topk, tree_tokens)
    trees            the eval.tree values besides "auto" (always mapped) that drafter_factory accepts
    prepare          optional (cfg, train_dataset, target) -> {tensor name: initial value} from the data
    reads            (cfg) -> the optional store keys its loss reads (TARGET_ARGMAX, or none)
    target_labels    (cfg) -> whether every label its loss reads is the target's (its distribution, features
                     or greedy token), none the sequence's own token: only then may train.assistant_only_loss
                     be false (on a prompt position the sequence's token is the user's, not the target's)
    script           the train/<script>.py entry that also trains it ("" = only `python -m train`)
    tiny             a tiny-run config (repo-relative) for tests and smoke runs ("" = none)
    """

    name: str
    config: type[HeadConfig]
    feature_layers: Callable[[Any, Any], list[int]]
    build: Callable[[Any, TargetIO], nn.Module]
    loss: Callable[[nn.Module, dict, TargetIO], tuple[torch.Tensor, dict[str, float]]]
    drafter_factory: Callable[[nn.Module, TargetIO, str, int], Callable[[], Drafter]]
    trees: tuple[str, ...] = ("chain",)
    prepare: Callable[[Any, Any, TargetIO], dict[str, torch.Tensor]] | None = None
    reads: Callable[[Any], frozenset[str]] = field(default=_reads_nothing_extra)
    target_labels: Callable[[Any], bool] = field(default=_labels_are_the_sequence)
    script: str = ""
    tiny: str = ""


_REGISTRY: dict[str, Family] = {}
_discovered = False


def register(family: Family) -> Family:
    """Add a family (returned unchanged); refuses a second, different family under the same name and a
    config whose default `family` is not the family's name (config.json and YAML pick the class by it)."""
    if family.config().family != family.name:
        raise ValueError(f"family '{family.name}': its config {family.config.__name__} has family "
                         f"'{family.config().family}'")
    known = _REGISTRY.get(family.name)
    if known is not None and known is not family:
        raise ValueError(f"head family '{family.name}' is registered twice")
    _REGISTRY[family.name] = family
    return family


def _discover() -> None:
    """Import every module and sub-package of `heads` once and register the FAMILIES each declares."""
    global _discovered
    if _discovered:
        return
    _discovered = True  # first: a family module asking the registry while it is imported must not recurse
    try:
        package = importlib.import_module("heads")
        for info in pkgutil.iter_modules(package.__path__, "heads."):
            for family in getattr(importlib.import_module(info.name), "FAMILIES", ()):
                register(family)
    except BaseException:
        _discovered = False  # a broken family module fails every question, not only the first
        raise


def get(name: str) -> Family:
    """The family called `name`; ValueError `unknown head family 'x' (known: a, b, ...)` otherwise."""
    _discover()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown head family '{name}' (known: {', '.join(names())})")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    """Every registered family name, sorted."""
    _discover()
    return tuple(sorted(_REGISTRY))


def trained_by(script: str) -> tuple[str, ...]:
    """The families whose `script` is `script` (what train/<script>.py accepts), sorted; ValueError for none
    (an empty list would let the script train any family)."""
    found = tuple(n for n in names() if _REGISTRY[n].script == script)
    if not found:
        raise ValueError(f"no head family names train/{script}.py as its script")
    return found
