"""Shared fixtures: tiny random targets built in-process (no download), temp run folders."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models are overhead-bound: one thread per process is as fast, and it keeps the 2-process
# tests (and subprocesses) from oversubscribing a 2-core machine, where idle OpenMP threads spin.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` run where a CUDA GPU is visible and are skipped elsewhere (one line says why)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target():
    """(model, tokenizer, TargetIO) of the tiny random Llama (hidden 64, 4 layers, byte vocab 259)."""
    from data.config import TargetConfig
    from data.target import load_target

    return load_target(TargetConfig(name_or_path="tiny-random-llama", device="cpu"))
