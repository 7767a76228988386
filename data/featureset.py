"""The one feature interface the training loop uses, offline (read the store) or online (run the target).

    fs = open_featureset(cfg, train_ds, target_model_or_None, layer_ids, "train")
    len(fs)              # samples
    fs.lengths           # real tokens per sample (for length bucketing: data.tokenize.length_buckets)
    batch = fs.batch([3, 17, 5])

`batch` returns the training batch dict of the project conventions, right padded to the longest sample:
    input_ids [B, T] long, attention_mask [B, T] long, loss_mask [B, T] long,
    last [B, T, H] float32, aux [B, T, k*H] float32 (only when layer_ids is not empty),
    target_argmax [B, T] long (the target's greedy next token at each position; only `with_argmax`, for
    heads whose loss reads it: online, it costs a full-vocab lm_head pass per batch),
all on the CPU (the loop moves them), features and argmax zero on padding positions in both modes.

cfg.features.mode picks the source:
  offline  reads STORE/<split_name> (cfg.features.store, relative to cfg.out unless absolute), written by
           `python -m data.extract`. Opening refuses, naming the mismatch, a store made for another target
           (heads.base.check_target: fingerprint of the model or of the given TargetIO; name and shapes
           too when no model is given), other layer ids, or other tokenized data (fingerprint, sample count
           or any sample's length).
  online   runs the frozen target over the padded batch (data.features.forward_features, no logits) on
           the target's device and leaves `last`/`aux` there; nothing touches the disk. With
           features.engine vllm the batch's rows go through vLLM's capture instead (data/vllm_capture.py:
           `online_capture` starts one engine per training process, checked against transformers first;
           `last` and the argmax come from the transformers target's own final norm and lm_head).
A test checks both modes give identical tensors on the tiny target (store in float32).
"""

from __future__ import annotations

from typing import Any

import datasets
import torch
from torch import nn

from data.config import RunConfig
from data.features import forward_features, greedy_ids
from data.store import StoreMismatchError, StoreReader, store_root
from heads.base import TargetIO, check_target


class FeatureSet:
    """Samples of one tokenized split with their target features; see the module docstring."""

    def __init__(self, dataset: datasets.Dataset, layer_ids: list[int], pad_id: int = 0,
                 reader: StoreReader | None = None, target_model: nn.Module | None = None, with_argmax: bool = True,
                 capture: Any = None):
        if (reader is None) == (target_model is None):
            raise ValueError("FeatureSet needs exactly one source: a store reader or a target model")
        self.dataset, self.layer_ids, self.pad_id = dataset, list(layer_ids), pad_id
        self.reader, self.target_model, self.with_argmax = reader, target_model, with_argmax
        self.capture = capture  # a data.vllm_capture.VllmCapture: online features from vLLM
        self.mode = "offline" if reader is not None else "online"
        self.lengths: list[int] = list(dataset["length"]) if len(dataset) else []

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        from data.tokenize import collate

        rows = self.dataset[list(indices)]
        out = collate([{"input_ids": a, "loss_mask": m} for a, m in zip(rows["input_ids"], rows["loss_mask"])],
                      self.pad_id)
        att = out["attention_mask"]
        if self.reader is not None:
            b, t = att.shape
            h = self.reader.hidden_size
            last = torch.zeros(b, t, h)
            aux = torch.zeros(b, t, self.reader.width - h) if self.layer_ids else None
            argmax = torch.zeros(b, t, dtype=torch.long) if self.with_argmax else None
            for j, i in enumerate(indices):
                s_last, s_aux = self.reader.sample(int(i))
                n = s_last.shape[0]
                last[j, :n] = s_last.float()
                if argmax is not None:
                    argmax[j, :n] = self.reader.target_argmax(int(i))
                if aux is not None:
                    aux[j, :n] = s_aux.float()
        elif self.capture is not None:
            last, aux, argmax = self._from_engine(rows["input_ids"], att)
        else:
            device = next(self.target_model.parameters()).device
            feats, _ = forward_features(self.target_model, out["input_ids"].to(device), att.to(device), self.layer_ids)
            keep = att.to(device).unsqueeze(-1).bool()
            # Padding positions hold whatever the target computed there; zero them as the store does.
            # Left on the target's device: the loop trains there, a trip through host memory would be waste.
            last = feats.last.masked_fill(~keep, 0).float()
            aux = None if feats.aux is None else feats.aux.masked_fill(~keep, 0).float()
            argmax = greedy_ids(self.target_model, feats.last).long().masked_fill(~keep[..., 0], 0) \
                if self.with_argmax else None
        out["last"] = last
        if argmax is not None:
            out["target_argmax"] = argmax
        if aux is not None:
            out["aux"] = aux
        return out

    def _from_engine(self, rows: list[list[int]], att: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """last, aux, argmax of the batch from vLLM's capture, laid out (right padded, zero there) as above."""
        from data.vllm_capture import vllm_features

        packed, top = vllm_features(self.target_model, self.capture, rows)  # samples one after another
        b, t = att.shape
        h = packed.shape[-1] // (1 + len(self.layer_ids))
        last = packed.new_zeros(b, t, h, dtype=torch.float32)
        aux = packed.new_zeros(b, t, packed.shape[-1] - h, dtype=torch.float32) if self.layer_ids else None
        argmax = torch.zeros(b, t, dtype=torch.long, device=packed.device) if self.with_argmax else None
        at = 0
        for j, ids in enumerate(rows):
            n = len(ids)
            last[j, :n] = packed[at:at + n, :h].float()
            if aux is not None:
                aux[j, :n] = packed[at:at + n, h:].float()
            if argmax is not None:
                argmax[j, :n] = top[at:at + n].long()
            at += n
        return last, aux, argmax


def online_capture(cfg: RunConfig, target_model: nn.Module | None, layer_ids: list[int], pool: datasets.Dataset,
                   rank: int = 0) -> Any:
    """The vLLM capture an online run with features.engine vllm draws its features from (None otherwise): one
    engine in this training process (tensor parallel from features.vllm_tensor_parallel_size), its spool in
    OUT/.vllm-spool-online-rRRRR, checked against transformers on a few samples of `pool` first (NumericsError,
    one line naming features.vllm_check_tolerance, above it)."""
    if cfg.features.mode != "online" or cfg.features.engine != "vllm":
        return None
    if target_model is None:
        raise ValueError("features.mode=online needs the target model (it computes the features)")
    from pathlib import Path

    # optional engine: imported only when asked for (the project never needs vLLM)
    from data.vllm_capture import start_checked

    longest = cfg.data.max_length or max(pool["length"], default=1)
    capture, _ = start_checked(cfg, target_model, layer_ids, pool, Path(cfg.out) / f".vllm-spool-online-r{rank:04d}",
                               longest + 1)
    return capture


def _check_store(reader: StoreReader, cfg: RunConfig, dataset: datasets.Dataset, target_model: nn.Module | None,
                 layer_ids: list[int], target: TargetIO | None = None) -> None:
    """Refuse a store that does not fit this run, naming the store folder and the mismatch."""
    from data.extract import target_info
    from data.target import load_config_only, text_config
    from data.tokenize import dataset_fingerprint

    m, where = reader.manifest, str(reader.folder)
    have = m["target"]
    if target_model is not None:
        want = target_info(target_model, cfg.target.name_or_path, cfg.target.revision)
    elif target is not None:
        want = target.record()  # the weights themselves: a folder refilled with other weights keeps its name
    else:
        tc = text_config(load_config_only(cfg.target))
        want = {"name_or_path": cfg.target.name_or_path, "hidden_size": int(tc.hidden_size),
                "num_hidden_layers": int(tc.num_hidden_layers), "vocab_size": int(tc.vocab_size)}
    if target_model is None and have.get("name_or_path") != want["name_or_path"]:
        raise StoreMismatchError(f"{where}: store made for a target with name_or_path {have.get('name_or_path')!r}, "
                                 f"but target.name_or_path gives {want['name_or_path']!r}")
    check_target(have, want, where, error=StoreMismatchError)
    if list(m["layer_ids"]) != list(layer_ids):
        raise StoreMismatchError(f"{where}: store has layer ids {m['layer_ids']} but the head needs {list(layer_ids)} "
                                 f"(re-extract for this head, or use features.mode=online)")
    if int(m["num_samples"]) != len(dataset):
        raise StoreMismatchError(f"{where}: store holds {m['num_samples']} samples, the tokenized split has {len(dataset)}")
    fp = dataset_fingerprint(dataset)
    if m["data_fingerprint"] != fp:
        raise StoreMismatchError(f"{where}: store made from other tokenized data (fingerprint "
                                 f"{m['data_fingerprint']}, this run's data {fp}); re-extract")
    lengths = list(dataset["length"]) if len(dataset) else []
    if reader.lengths != lengths:
        bad = next(i for i, (a, b) in enumerate(zip(reader.lengths, lengths)) if a != b)
        raise StoreMismatchError(f"{where}: sample {bad} has {reader.lengths[bad]} tokens in the store, "
                                 f"{lengths[bad]} in the tokenized data; re-extract")


def open_featureset(cfg: RunConfig, dataset: datasets.Dataset, target_model: nn.Module | None, layer_ids: list[int],
                    split_name: str, pad_id: int = 0, target: TargetIO | None = None,
                    with_argmax: bool = True, capture: Any = None) -> FeatureSet:
    """A FeatureSet over `dataset` in cfg.features.mode (see the module docstring for the checks).

    `target`: the loaded target's TargetIO when no model is given (offline training passes it), so a
    store of other weights under the same name and shapes is refused by its fingerprint. `capture`: the
    run's online_capture (online with features.engine vllm; one engine serves every split)."""
    mode = cfg.features.mode
    if mode == "online":
        if target_model is None:
            raise ValueError("features.mode=online needs the target model (it computes the features)")
        if cfg.features.engine == "vllm" and capture is None:
            raise ValueError("features.engine=vllm online needs the run's capture (data.featureset.online_capture)")
        return FeatureSet(dataset, layer_ids, pad_id, target_model=target_model, with_argmax=with_argmax,
                          capture=capture)
    reader = StoreReader(store_root(cfg) / split_name, verify_checksums=cfg.features.verify_on_read)
    _check_store(reader, cfg, dataset, target_model, layer_ids, target)
    return FeatureSet(dataset, layer_ids, pad_id, reader=reader, with_argmax=with_argmax)
