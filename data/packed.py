"""CPU kernels for the linear layers of a float32 target: the cheap verify pass speculative decoding needs.

Three kinds, `target.cpu_kernels`: dense (torch's F.linear), packed (oneDNN-prepacked weights, PackedLinear)
and skinny (per row count, the MKL product timed fastest for each weight shape, SkinnyLinear); `auto` times
whole passes with each at load and keeps the fastest.

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
passes over 1-4 tokens every way on the machine at hand (choose_kernels: 16 passes a kind at load) and keep
packed or skinny only where it is at least AUTO_MARGIN cheaper; otherwise the nn.Linear layers stay.
The choice is printed; a machine near the margin can choose differently from one load to the next (set
`packed`, `skinny` or `dense` to pin it).

Skinny. On a 2-core AMD EPYC (AVX2, no AVX-512) neither did: T(1..4) = 62 / 98 / 122 / 104 ms dense and
58 / 93 / 92 / 96 ms packed, so one drafted token cost 0.6 of a plain pass and no trained head paid. There
F.linear's 2-4-row products run at half speed: through 30 of the 1536 x 576 matrices, per matrix (us,
median; 49152 x 576 in ms)

    rows                        1      2      3      4
    F.linear (x W^T)           340    527    645    511        49152 x 576:  8.8   19.8   30.4   21.2
    torch.mm(W, x^T)^T         312    256    396    201                      8.5    7.3   10.8    7.4
    x @ (row-major W^T copy)   204    333    404    535                      5.0   10.5   16.5   27.9

while the same product transposed, with the rows as MKL's narrow operand, costs no more for 2 or 4 rows than
for one, and three rows cost twice four. SkinnyLinear takes, per row count 1..SKINNY_ROWS and weight shape,
the kernel and the row count (zero rows padding up to it) timed fastest (plan_rows, once per shape at load),
and F.linear beyond. Its output is made contiguous: W x^T's rows left transposed kept that layout through the
MLP's product, and the down projection's kernel then took 0.69 ms for 2 rows instead of 0.23. Whole passes
measured T(1..4) = 53 / 55 / 58 / 56 ms there (median of 15, 128-token context): one drafted token costs 0.04 of a
plain pass instead of 0.6. The plan is timed, not assumed: on another CPU a row count may keep F.linear.

Batched generation (prompt writing, regeneration: 32 rows a pass) runs dense under `auto`, untimed, so the
data stages' outputs never depend on a timing: the same speed either way on the first machine, and dense the
faster on an AVX-512/AMX one (`scripts/bench_regenerate.py --batches 32 --kernels packed,dense`, the
quickstart's first 64 prompts, 128 tokens: 169 against 194 tokens/s, answers identical).

`target.cpu_kernels: packed` (or `skinny`) applies it wherever the target decodes
(`data.target.load_model(cfg, decode=True)`): eval, prompt writing, regeneration. A packed or skinny layer
keeps its dense `weight`/`bias` (shared, so code that reads `lm_head.weight` and the fingerprint see the same
tensors) and falls back to the dense kernel whenever autograd is on, the input is not float32, or oneDNN is
missing, so training never goes through it. The packed copy (and a skinny layer's W^T copy) is taken once:
weights changed after packing are not seen (pack after loading). A deep copy of either is a dense nn.Linear
(so an MTP head can copy a packed target's last layer).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Mapping, Sequence

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
        self.weight = linear.weight  # the same Parameter: state_dict, tying and fingerprints are unchanged
        self.bias = linear.bias
        with torch.no_grad():
            self._packed_weight = linear.weight.detach().to_mkldnn()
            self._packed_bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
                or (self.dense_single_row and x.numel() == self.in_features)):
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        y = torch._C._nn.mkldnn_linear(rows, self._packed_weight, self._packed_bias).to_dense()
        return y.reshape(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        """A copy is a dense nn.Linear of copied weights: oneDNN's packed tensor has no storage to copy (a head
        built from a copy of the target's layer, an MTP block, would fail on a packed target), and a copy is
        for changing, which the packed copy would not follow (the module docstring)."""
        return _dense_copy(self, memo)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _dense_copy(layer: PackedLinear | SkinnyLinear, memo: dict) -> nn.Linear:
    """An nn.Linear of deep copies of `layer`'s weight and bias (its __deepcopy__)."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    linear.weight = copy.deepcopy(layer.weight, memo)
    linear.bias = copy.deepcopy(layer.bias, memo)
    memo[id(layer)] = linear
    return linear


def can_pack(linear: nn.Module, min_numel: int | None = None) -> bool:
    """Whether `linear` is a plain nn.Linear worth a faster kernel: CPU, float32, oneDNN built in, and at least
    min_numel weights (default MIN_SMALL_NUMEL)."""
    least = MIN_SMALL_NUMEL if min_numel is None else min_numel
    return (type(linear) is nn.Linear and torch.backends.mkldnn.is_available() and linear.weight.numel() >= least
            and linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32)


Slot = tuple[nn.Module, str, nn.Module]  # (parent, attribute name, the layer there)


def _slots(module: nn.Module, min_numel: int | None = None) -> list[Slot]:
    """Every packable nn.Linear under `module` (itself excluded), with where it hangs."""
    found: list[Slot] = []
    for name, child in module.named_children():
        if can_pack(child, min_numel):
            found.append((module, name, child))
        else:
            found.extend(_slots(child, min_numel))
    return found


def _install(slots: Sequence[Slot], layers: Sequence[nn.Module]) -> None:
    """Hang layers[i] where slots[i] is."""
    for (parent, name, _), layer in zip(slots, layers):
        setattr(parent, name, layer)


def _packed(linear: nn.Linear) -> PackedLinear:
    return PackedLinear(linear, dense_single_row=linear.weight.numel() < MIN_PACKED_NUMEL)


def pack_linears(module: nn.Module, min_numel: int | None = None) -> int:
    """Replace every packable nn.Linear under `module` (itself excluded) by a PackedLinear; return how many.

    Those under MIN_PACKED_NUMEL weights keep the dense kernel for a single row (see the module docstring)."""
    slots = _slots(module, min_numel)
    _install(slots, [_packed(linear) for _, _, linear in slots])
    return len(slots)


SKINNY_ROWS = 8  # row counts with a kernel plan of their own; more rows (batched generation) take F.linear
SKINNY_KERNELS = ("dense", "wx", "xw")  # F.linear; W @ x^T (x the small operand); x @ (W^T stored row-major)
PLAN_REPEATS = 5  # timed rounds per (kernel, rows) cell of a plan: about a second per weight shape of SmolLM2


class SkinnyLinear(nn.Module):
    """An nn.Linear that sends each small row count to the kernel timed fastest for its shape on this machine.

    `plan[rows] = (kernel, computed)`: `computed` >= rows rows go through `kernel`, the extra ones zeros (on the
    AMD EPYC three rows cost twice four through W @ x^T). Kernels: "dense" F.linear; "wx" the product
    transposed, torch.mm(W, x^T), where MKL treats the 2-8 rows as the narrow operand; "xw" x @ W^T from a
    row-major copy of W^T (held only when some row count uses it). Rows without a plan, autograd, or an input
    that is not float32 on the CPU take F.linear, so training never goes through it."""

    def __init__(self, linear: nn.Linear, plan: Mapping[int, tuple[str, int]]) -> None:
        super().__init__()
        if bad := [k for k, _ in plan.values() if k not in SKINNY_KERNELS]:
            raise ValueError(f"SkinnyLinear: unknown kernel {bad[0]!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: state_dict, tying and fingerprints are unchanged
        self.bias = linear.bias
        self.plan = dict(plan)
        uses_xw = any(k == "xw" for k, _ in self.plan.values())
        self._wt = linear.weight.detach().t().contiguous() if uses_xw else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        step = self.plan.get(rows)
        if (step is None or step == ("dense", rows) or torch.is_grad_enabled() or x.dtype != torch.float32
                or x.device.type != "cpu"):
            return F.linear(x, self.weight, self.bias)
        kernel, computed = step
        flat = x.reshape(rows, self.in_features)
        if computed > rows:
            flat = torch.cat([flat, flat.new_zeros(computed - rows, self.in_features)])
        # contiguous: "wx"'s transposed rows, fed on (through the MLP's product) to the next layer's kernel,
        # cost SmolLM2's down projection 0.69 ms for 2 rows instead of 0.23
        y = _kernel(kernel, flat, self.weight, self._wt)[:rows].contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        """A dense nn.Linear of copied weights, as PackedLinear's (a copy is for changing; the W^T copy would
        not follow)."""
        return _dense_copy(self, memo)

    def extra_repr(self) -> str:
        plan = ", ".join(f"{r}: {k}" + (f" as {c}" if c > r else "") for r, (k, c) in sorted(self.plan.items()))
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"plan={{{plan}}}"


def _kernel(kernel: str, x: torch.Tensor, weight: torch.Tensor, wt: torch.Tensor | None) -> torch.Tensor:
    if kernel == "xw":
        return torch.mm(x, wt)
    if kernel == "wx":
        return torch.mm(weight, x.t()).t()
    return F.linear(x, weight)


@torch.no_grad()
def plan_rows(linears: Sequence[nn.Linear], rows: int = SKINNY_ROWS,
              repeats: int = PLAN_REPEATS) -> dict[int, tuple[str, int]]:
    """Per row count 1..rows, the (kernel, computed rows) with the lowest median time through these same-shaped
    layers one after another (their weights read from memory, as in a pass), a computed count above the row
    count padding with zeros. Round-robin over cells so drift in the machine's load hits every cell alike."""
    weights = [lin.weight.detach() for lin in linears]
    wts = [w.t().contiguous() for w in weights]
    g = torch.Generator().manual_seed(0)
    xs = {m: torch.randn(m, weights[0].shape[1], generator=g) for m in range(1, rows + 1)}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats + 1):  # round 0 warms every shape up
        for m, x in xs.items():
            for kernel in SKINNY_KERNELS:
                t = time.perf_counter()
                for w, wt in zip(weights, wts):
                    _kernel(kernel, x, w, wt)
                if r:
                    times.setdefault((kernel, m), []).append(time.perf_counter() - t)
    median = {cell: statistics.median(ts) for cell, ts in times.items()}
    return {m: min(((k, c) for c in range(m, rows + 1) for k in SKINNY_KERNELS), key=median.__getitem__)
            for m in xs}


def skinny_linears(module: nn.Module, min_numel: int | None = None) -> int:
    """Replace every packable nn.Linear under `module` by a SkinnyLinear whose plan is timed here, once per
    weight shape (plan_rows); return how many."""
    slots = _slots(module, min_numel)
    _install(slots, _skinny(slots))
    return len(slots)


def _skinny(slots: Sequence[Slot]) -> list[SkinnyLinear]:
    """A SkinnyLinear per slot, one plan per weight shape."""
    shapes: dict[tuple[int, ...], list[nn.Linear]] = {}
    for _, _, linear in slots:
        shapes.setdefault(tuple(linear.weight.shape), []).append(linear)
    plans = {shape: plan_rows(linears) for shape, linears in shapes.items()}
    return [SkinnyLinear(linear, plans[tuple(linear.weight.shape)]) for _, _, linear in slots]


@torch.no_grad()
def _time_passes(model: nn.Module, variants: Mapping[str, Sequence[nn.Module]], slots: Sequence[Slot],
                 rows: tuple[int, ...], context: int, repeats: int) -> dict[str, list[float]]:
    """Median seconds of one cached target pass over n tokens, n in `rows`, with each kind's layers in the slots.

    Round-robin over kinds and widths so drift in the machine's load hits every cell alike; all logits are
    computed, as a verify pass does; every pass is cropped away again so each sees the same context."""
    # here, not at the top: data.kvcache imports data.target, which imports this module
    from data.kvcache import new_kv, timed_pass

    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(0)
    kv = new_kv(model, "dynamic", room=context + max(rows))
    kv.run(torch.randint(vocab, (1, context), generator=g), logits_to_keep=1)
    kv.keep(range(context))
    ids = torch.randint(vocab, (1, max(rows)), generator=g)
    times: dict[tuple[str, int], list[float]] = {}
    kinds = list(variants)
    for r in range(repeats + 1):  # round 0 warms every shape up
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            _install(slots, variants[kind])
            for n in rows:
                dt = timed_pass(kv, ids[:, :n])
                if r:
                    times.setdefault((kind, n), []).append(dt)
    return {kind: [statistics.median(times[kind, n]) for n in rows] for kind in kinds}


def choose_kernels(model: nn.Module, rows: tuple[int, ...] = AUTO_ROWS, context: int = 128,
                   repeats: int = 3) -> str:
    """Time `model`'s passes with its linears dense, packed and skinny on this machine; keep the fastest.

    A kernel other than dense is kept only when its summed pass time over `rows` is at least AUTO_MARGIN below
    dense's; the others' copies are dropped. Nothing to pack (small or non-float32 targets): dense, untimed."""
    slots = _slots(model)
    if not slots:
        return "dense"
    variants = {"dense": [linear for _, _, linear in slots], "packed": [_packed(linear) for _, _, linear in slots],
                "skinny": _skinny(slots)}
    t = _time_passes(model, variants, slots, rows, context, repeats)
    best = min(("packed", "skinny"), key=lambda k: sum(t[k]))
    kind = best if sum(t[best]) < (1 - AUTO_MARGIN) * sum(t["dense"]) else "dense"
    _install(slots, variants[kind])
    ms = {k: " / ".join(f"{1000 * s:.0f}" for s in v) for k, v in t.items()}
    timings = ", ".join(f"{k} {v} ms" for k, v in ms.items())
    print(f"target.cpu_kernels auto: {kind} (T({rows[0]}..{rows[-1]}) {timings})", file=sys.stderr)
    return kind
