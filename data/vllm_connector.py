"""The KV-transfer connector vLLM's `extract_hidden_states` method hands captured layers to (vLLM workers only).

Not imported by the project itself: vLLM's worker processes load it by name, from the kv_transfer_config
that data.vllm_capture.VllmCapture builds
(`{"kv_connector": "HiddenStatesSpool", "kv_connector_module_path": "data.vllm_connector", ...}`), so this
module may import vLLM at the top. To see it work: `python -m data.extract --config C --features.engine=vllm`.

What it does: for every finished request (one prompt, `max_tokens=1`), the hidden states vLLM cached for its
prompt tokens, [T, n_layers, H] in the target's dtype, plus the prompt's token ids, are written with
safetensors to `<shared_storage_path>/<request id>.safetensors` (the path comes back to the caller in the
request's kv_transfer_params). The parent process (data.vllm_capture) reads and deletes each file and hands
the tensors to data.extract's one shard writer; this connector writes no store file.

Why a subclass and not vLLM's ExampleHiddenStatesConnector as is: the example copies device-to-host on a
CUDA stream into pinned memory and polls a CUDA event, which fails on a CPU build (no CUDA runtime). On
CPU the cache already lives in host memory, so the copy is a plain gather written in the worker's own
thread; the example's lock file is kept (vLLM may return the request to the caller one engine step before
the file is written: the caller waits on the lock, data.vllm_capture). On a GPU the example's path is kept.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for a CUDA event that has completed (get_finished only calls query())."""

    @staticmethod
    def query() -> bool:
        return True


class HiddenStatesSpool(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector that also works on vLLM's CPU build (see the module docstring)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type == "cuda":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        n = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots, n).clone()  # [T, n_layers, H]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken (LOCK_EX) in wait_for_save
        try:
            save_file({"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()},
                      pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader waiting in load_hidden_states
        self._req_copy_events[pending.req_id] = _Done()
