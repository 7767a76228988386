"""Prepacked (oneDNN) linear layers for CPU inference: the cheap verify pass speculative decoding needs.

On a CPU, `torch.nn.functional.linear` is a poor fit for the shapes a verify pass has: 2-3 rows through a
large matrix. Measured on the project's 2-core AVX machine, the tied 49152 x 576 output projection of
SmolLM2-135M took (ms, fp32, median of 30)

    rows           1      2      3      4      8
    dense (2 thr)  9.7   23.7   36.3   17.1   16.1
    packed (2 thr) 4.4    5.5    6.3    6.4    7.4
    dense (1 thr) 10.0   24.0     -    17.0     -
    packed (1 thr) 8.3    9.7     -    11.1     -

so the whole target pass over n tokens, as eval.costs times it (1 thread, 53-token context), went from
T(1..4, 8) = 55 / 90 / 110 / 86 / 96 ms dense to 59 / 75 / 78 / 82 / 92 ms with every linear packed. Verifying
k drafted tokens is a pass over k+1 rows, so the dense curve priced drafting out unless acceptance was very
high. The decoder layers' matrices (576 x 1536 and smaller for SmolLM2) matter as much once they are read
from memory, as in a real pass (30 layers, 540 MB of weights, none of it cached): with two threads the
target pass over a 200-token context measured (ms, median of 25)

    T(n), n =                               1      2      3      4      8
    output projection packed, 2 threads   51.3   81.2   93.4   80.8   84.9
    every matrix packed, 2 threads        51.8   62.4   64.8   67.9   77.7
    output projection packed, 1 thread    54.7   84.6   92.9   78.4   93.1
    every matrix packed, 1 thread         55.7   78.3   83.1   86.0   95.3

so verifying one drafted token went from 1.6 to 1.2 times a plain pass on two threads. One row through
a small packed matrix is slower than the dense kernel on one thread (T(1) 60.6 ms with every matrix packed
and no exception), so matrices under MIN_PACKED_NUMEL send a single row to the dense kernel; the output
projection (at least MIN_PACKED_NUMEL weights) is faster packed at every row count. Batched generation
(32 rows) runs at the same speed either way. Every speedup is measured against plain decoding on the same
packed model.

    from data.packed import pack_linears
    n = pack_linears(model)        # every nn.Linear on the CPU in float32 -> PackedLinear (in place)

That machine's finding does not carry over. On a later 2-core AVX-512 machine (MKL 2024.2, oneDNN 3.12) the
same target measured T(1..4) = 49 / 49 / 53 / 74 ms dense and 48 / 113 / 101 / 117 ms packed (2 threads,
256-token context): there oneDNN's per-call conversions cost more than MKL's small-row kernels save, and
packing made a verify pass 2.3x a plain one. So the default, `target.cpu_kernels: auto`, has the decoder's
target (`load_model(cfg, decode=True, verify=True)`: eval, the benchmarks) pack, then time whole target
passes over 1-4 tokens both ways on the machine at hand (choose_kernels: 32 passes at load) and keep packed
only where it is at least AUTO_MARGIN cheaper; otherwise the layers go back to nn.Linear. The choice is
printed; a machine near the margin can choose differently from one load to the next (set `packed` or
`dense` to pin it). Batched generation (prompt writing, regeneration: 32 rows a pass) runs dense under `auto`,
untimed, so the data stages' outputs never depend on a timing: the same speed either way on the first
machine, and dense the faster on an AVX-512/AMX one (`scripts/bench_regenerate.py --batches 32 --kernels
packed,dense`, the quickstart's first 64 prompts, 128 tokens: 169 against 194 tokens/s, answers identical).

`target.cpu_kernels: packed` applies it wherever the target decodes
(`data.target.load_model(cfg, decode=True)`): eval, prompt writing, regeneration. A packed layer keeps its dense `weight`/`bias` (shared, so code that reads
`lm_head.weight` and the fingerprint see the same tensors) and falls back to the dense kernel whenever
autograd is on, the input is not float32, or oneDNN is missing, so training never goes through it. The
packed copy is taken once: weights changed after packing are not seen (pack after loading). A deep copy of a
packed layer is a dense nn.Linear (so an MTP head can copy a packed target's last layer).
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

MIN_PACKED_NUMEL = 1 << 22  # 4M weights: an LLM's output projection, or every layer of a 4096-wide model
MIN_SMALL_NUMEL = 1 << 16  # below this a matrix is not worth oneDNN's per-call overhead at any row count
AUTO_ROWS = (1, 2, 3, 4)  # the widths of a plain step and of verifying 1-3 drafted tokens
AUTO_MARGIN = 0.10  # packed must save this share of the summed pass time: nearer than that is timing noise


class PackedLinear(nn.Module):
    """An nn.Linear whose weight is also held in oneDNN's blocked layout for inference on the CPU."""

    def __init__(self, linear: nn.Linear, dense_single_row: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dense_single_row = dense_single_row  # one row (a plain decode step) takes the dense kernel
        self.active = True  # False: always the dense kernel (choose_kernels times both)
        self.weight = linear.weight  # the same Parameter: state_dict, tying and fingerprints are unchanged
        self.bias = linear.bias
        with torch.no_grad():
            self._packed_weight = linear.weight.detach().to_mkldnn()
            self._packed_bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not self.active or torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
                or (self.dense_single_row and x.numel() == self.in_features)):
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        y = torch._C._nn.mkldnn_linear(rows, self._packed_weight, self._packed_bias).to_dense()
        return y.reshape(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        """A copy is a dense nn.Linear of copied weights: oneDNN's packed tensor has no storage to copy (a head
        built from a copy of the target's layer, an MTP block, would fail on a packed target), and a copy is
        for changing, which the packed copy would not follow (the module docstring)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = copy.deepcopy(self.weight, memo)
        linear.bias = copy.deepcopy(self.bias, memo)
        memo[id(self)] = linear
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(linear: nn.Module, min_numel: int | None = None) -> bool:
    """Whether `linear` is a plain nn.Linear worth packing: CPU, float32, oneDNN built in, and at least
    min_numel weights (default MIN_SMALL_NUMEL)."""
    least = MIN_SMALL_NUMEL if min_numel is None else min_numel
    return (type(linear) is nn.Linear and torch.backends.mkldnn.is_available() and linear.weight.numel() >= least
            and linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32)


def pack_linears(module: nn.Module, min_numel: int | None = None) -> int:
    """Replace every packable nn.Linear under `module` (itself excluded) by a PackedLinear; return how many.

    Those under MIN_PACKED_NUMEL weights keep the dense kernel for a single row (see the module docstring)."""
    count = 0
    for name, child in module.named_children():
        if can_pack(child, min_numel):
            setattr(module, name, PackedLinear(child, dense_single_row=child.weight.numel() < MIN_PACKED_NUMEL))
            count += 1
        else:
            count += pack_linears(child, min_numel)
    return count


def unpack_linears(module: nn.Module) -> int:
    """Put back an nn.Linear (the same weight and bias Parameters) for every PackedLinear under `module`."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, PackedLinear):
            linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            linear.weight, linear.bias = child.weight, child.bias
            setattr(module, name, linear)
            count += 1
        else:
            count += unpack_linears(child)
    return count


@torch.no_grad()
def _time_passes(model: nn.Module, rows: tuple[int, ...], context: int, repeats: int) -> dict[str, list[float]]:
    """Median seconds of one cached target pass over n tokens, n in `rows`, with the packed kernels on and off.

    Round-robin over kernels and widths so drift in the machine's load hits every cell alike; all logits are
    computed, as a verify pass does; every pass is cropped away again so each sees the same context."""
    # here, not at the top: data.kvcache imports data.target, which imports this module
    from data.kvcache import new_kv, timed_pass

    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(0)
    kv = new_kv(model, "dynamic", room=context + max(rows))
    kv.run(torch.randint(vocab, (1, context), generator=g), logits_to_keep=1)
    kv.keep(range(context))
    ids = torch.randint(vocab, (1, max(rows)), generator=g)
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats + 1):  # round 0 warms every shape up
        for kind in (("packed", "dense") if r % 2 else ("dense", "packed")):
            for layer in layers:
                layer.active = kind == "packed"
            for n in rows:
                dt = timed_pass(kv, ids[:, :n])
                if r:
                    times.setdefault((kind, n), []).append(dt)
    for layer in layers:
        layer.active = True
    return {kind: [statistics.median(times[kind, n]) for n in rows] for kind in ("dense", "packed")}


def choose_kernels(model: nn.Module, rows: tuple[int, ...] = AUTO_ROWS, context: int = 128,
                   repeats: int = 3) -> str:
    """Pack `model`'s linears, time both kernels on this machine and keep the faster ("packed" or "dense").

    Packed is kept only when the summed pass time over `rows` is at least AUTO_MARGIN below dense's; else the
    layers are unpacked again (no oneDNN copies kept). Nothing to pack (small or non-float32 targets): dense,
    untimed."""
    if pack_linears(model) == 0:
        return "dense"
    t = _time_passes(model, rows, context, repeats)
    kind = "packed" if sum(t["packed"]) < (1 - AUTO_MARGIN) * sum(t["dense"]) else "dense"
    if kind == "dense":
        unpack_linears(model)
    ms = {k: " / ".join(f"{1000 * s:.0f}" for s in v) for k, v in t.items()}
    print(f"target.cpu_kernels auto: {kind} (T({rows[0]}..{rows[-1]}) dense {ms['dense']} ms, packed "
          f"{ms['packed']} ms)", file=sys.stderr)
    return kind
