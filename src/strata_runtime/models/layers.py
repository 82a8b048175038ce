"""Building blocks shared by the model files: linear layers and embeddings
over GGUF weights, RMSNorm, rotary embeddings."""

from __future__ import annotations

import math
import weakref
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from strata_kernels import (
    QuantTensor,
    WordPlanes,
    cpu_kernels,
    dequantize,
    embedding_rows,
    has_word_layout,
    planes_matmul,
    planes_rows,
    prepare_rows,
    qmatmul,
)
from strata_kernels.formats import FLOAT_TYPES
from strata_kernels.launch import CPU_GEMV_MAX_M
from strata_kernels.qmatmul import preparation_key

from ..files import Backend


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` for a GGUF weight of logical shape ``[out, in]``.

    Invariant: exactly one of ``planes`` (the weight in its GPU word layout,
    built once here on the Triton backend for the types that have one: the
    blocks are not kept), ``qweight`` (the GGUF blocks, read by ``qmatmul``
    without a dense copy, where ``backend.keeps_blocks`` says) and ``weight``
    (the dequantization in the backend's activation dtype, exact for float32)
    is set; ``bias`` is None or ``[out]`` in that dtype.
    """

    def __init__(self, weight: QuantTensor, backend: Backend, bias: QuantTensor | None = None):
        super().__init__()
        dtype = backend.activations
        self.bias = None if bias is None else nn.Parameter(dequantize(bias, dtype).reshape(-1), requires_grad=False)
        self.qweight: QuantTensor | None = None
        self.planes: WordPlanes | None = None
        self.weight = None
        self.source_type = weight.qtype.name  # the file's type, whatever form the weight takes here
        if backend.kernels == "triton" and has_word_layout(weight):
            self.planes = WordPlanes.of(weight)
        elif backend.keeps_blocks(weight):
            self.qweight = weight
        else:
            self.weight = nn.Parameter(dequantize(weight, dtype), requires_grad=False)
        # Blocks read by the compiled CPU kernels (see ``Projections``), and
        # the dtype their prefill GEMMs run in.
        self.cpu_blocks = self.qweight is not None and backend.cpu_kernels
        self.gemm_dtype = backend.prefill_matmuls
        # Through a weak proxy: a layer that held itself in a cycle kept its
        # weights alive after the model was dropped, until the garbage
        # collector happened to run (700 MiB a Gemma engine on the exact path).
        self.projection = Projections(weakref.proxy(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x)[0]

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] if self.weight is not None else (self.planes or self.qweight).rows

    def matmul(self, x: torch.Tensor, prepared=None) -> torch.Tensor:
        """``forward`` by ``F.linear``, ``planes_matmul`` (``prepared``: x made
        ready for it once, see ``Projections``) or ``qmatmul`` (without
        ``Projections``' GEMV call)."""
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        if self.planes is not None:
            y = planes_matmul(flat, self.planes, prepared)
        elif self.cpu_blocks:
            y = cpu_kernels.qmatmul_cpu(flat, self.qweight, self.gemm_dtype)
        else:
            y = qmatmul(flat, self.qweight)
        return self.add_bias(y.reshape(*x.shape[:-1], self.out_features))


class Projections:
    """``Projections(*layers)(x) == [layer.matmul(x) for layer in layers]`` for
    linear layers that read the same input (q/k/v, gate/up, or one layer).
    When all hold CPU blocks and ``x`` is a decode step's few float32 or
    bfloat16 rows, one GEMV call computes them all: one pass over ``x``, one
    parallel region, and the kernel's arguments made here once (at decode
    sizes, building them per call cost a tenth of the product). Layers in GPU
    word layouts share x's preparation (16-bit codes) where their words pair
    alike.

    Invariant: ``blocks`` is None or the layers' blocks and GGML type ids in
    order, as ``cpu_kernels.gemv_blocks`` takes them."""

    def __init__(self, *layers: Linear):
        self.layers = layers
        self.blocks = None
        if all(layer.cpu_blocks for layer in layers):
            self.blocks = cpu_kernels.gemv_arguments([layer.qweight for layer in layers])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        rows = x.numel() // x.shape[-1]
        if any(layer.planes is not None for layer in self.layers):
            return self._planes(x)
        if self.blocks is None or rows > CPU_GEMV_MAX_M or x.dtype not in (torch.float32, torch.bfloat16):
            return [layer.matmul(x) for layer in self.layers]
        outs = cpu_kernels.gemv_blocks(x.reshape(rows, x.shape[-1]), *self.blocks)
        if len(x.shape) != 2:
            outs = [y.reshape(*x.shape[:-1], y.shape[-1]) for y in outs]
        return [layer.add_bias(y) for layer, y in zip(self.layers, outs)]

    def _planes(self, x: torch.Tensor) -> list[torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        prepared: dict[str, object] = {}  # x once per preparation (the GEMV path and its pairing)
        outs = []
        for layer in self.layers:
            made = None
            if layer.planes is not None:
                key = preparation_key(flat.shape[0], layer.planes)
                if key not in prepared:
                    prepared[key] = prepare_rows(flat, layer.planes)
                made = prepared[key]
            outs.append(layer.matmul(x, made) if layer.planes is not None else layer.matmul(x))
        return outs


class TiedEmbedding(nn.Module):
    """The token table, used both to embed tokens and, transposed, to score
    them. Same storage rule as ``Linear``: GGUF blocks where ``Linear`` keeps
    them, or its GPU word planes (rows are dequantized as they are looked
    up), the dense table otherwise."""

    def __init__(self, weight: QuantTensor, backend: Backend):
        super().__init__()
        self.out = Linear(weight, backend)
        self.dtype = backend.activations

    @property
    def device(self) -> torch.device:
        held = self.out.weight if self.out.weight is not None else self.out.planes or self.out.qweight
        return held.device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.out.weight is not None:
            return self.out.weight[tokens]
        if self.out.planes is not None:
            return planes_rows(self.out.planes, tokens, self.dtype).reshape(*tokens.shape, -1)
        return embedding_rows(self.out.qweight, tokens, self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 scores. A decode step's few rows go in as float32 too (the
        CPU GEMV accumulates in float32 either way), so the logits are not
        rounded to bfloat16 (a step of 0.125 at 20) before sampling."""
        if (self.out.qweight is not None or self.out.planes is not None) and x.shape[0] <= CPU_GEMV_MAX_M:
            return self.out(x.float())
        return self.out(x).float()


class RMSNorm(nn.Module):
    """RMSNorm whose GGUF weight is the full multiplier (converters fold in
    the ``1 +`` that Gemma's checkpoints keep separately).

    ``forward(x, residual=None, rope=None)``: the norm of ``x``, then the
    rotary embedding ``rope`` (cos, sin) if given, then ``residual +`` if
    given: the ops that follow a norm in a transformer, one kernel call on
    the CPU fast path (torch's own rms_norm is five ops there, 25 us at
    decode sizes), plain torch ops otherwise.
    """

    def __init__(self, weight: QuantTensor, eps: float, backend: Backend):
        super().__init__()
        self.weight = nn.Parameter(dequantize(weight).reshape(-1), requires_grad=False)
        self.eps = eps
        self.cpu_kernel = backend.cpu_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.cpu_kernel:
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual, rope)
        y = F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
        if rope is not None:
            y = apply_rope(y, *rope)
        return y if residual is None else residual + y


def rope_inverse_frequencies(head_dim: int, base: float, linear_scale: float = 1.0) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents) / linear_scale


def yarn_inverse_frequencies(head_dim: int, base: float, factor: float, original_context: int,
                             beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """YaRN: each frequency between extrapolated (unscaled, the fast ones
    that turn more than ``beta_fast`` times over the original context) and
    interpolated (divided by ``factor``, the slow ones that turn fewer than
    ``beta_slow`` times), on a linear ramp between the two dimensions; as
    llama.cpp's ``rope_yarn`` and the YaRN paper compute it. The attention
    factor that goes with it is ``yarn_attention_factor``."""
    def dimension_of(rotations: float) -> float:
        return head_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dimension_of(beta_fast)), 0)
    high = min(math.ceil(dimension_of(beta_slow)), head_dim - 1)
    extrapolated = rope_inverse_frequencies(head_dim, base)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's scale of cos and sin (so of queries and keys alike): 1 + 0.1 ln(factor)."""
    return 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, 1, dim]`` for ``apply_rope`` (made once per layer call,
    shared by its queries and keys)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos()[:, None, :].to(dtype), angles.sin()[:, None, :].to(dtype)


class RopeCache:
    """The cos/sin tables of the latest step, shared by every layer with the
    same inverse frequencies, so a step computes them once, not per layer.

    Invariant: ``cached`` are the tables of exactly the values of
    ``positions`` (for ``key`` = ``(dtype, device)``), the tensor they were
    made from, kept so no other tensor takes its identity (positions are
    never changed in place). A step's positions need not be consecutive: a
    batch holds each sequence's next positions one after another, and two
    steps may share the first position and the count with different values
    after it, so a hit is the same tensor or equal values, never less.
    """

    def __init__(self):
        self.key = self.positions = self.cached = None

    def tables(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
        key = (dtype, inv_freq.device)
        # The same positions tensor reaches every layer of a step: found by
        # identity before reading any value (a read costs a microsecond on
        # the CPU, a device sync on a GPU; a step pays it once).
        if positions is self.positions and key == self.key:
            return self.cached
        old = self.positions
        if not (key == self.key and old is not None and old.shape == positions.shape
                and old.device == positions.device and torch.equal(old, positions)):
            self.key, self.cached = key, rope_tables(positions, inv_freq, dtype)
        self.positions = positions
        return self.cached


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX-style rotary embedding (halves rotated) of ``x`` ``[T, heads, dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, cpu_kernel: bool = False) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up``, the gated MLP's middle: one
    kernel call on the CPU kernels' backend, two torch ops otherwise."""
    if cpu_kernel:
        return cpu_kernels.gelu_tanh_mul(gate, up)
    return F.gelu(gate, approximate="tanh") * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor, cpu_kernel: bool = False) -> torch.Tensor:
    """``silu(gate) * up``, the SiLU-gated MLP's middle (Llama, Qwen): one
    kernel call on the CPU kernels' backend, two torch ops otherwise."""
    if cpu_kernel:
        return cpu_kernels.silu_mul(gate, up)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """``down(act_mul(gate(x), up(x)))`` over layer ``layer``'s ``ffn_gate``,
    ``ffn_up`` and ``ffn_down`` (each name followed by ``suffix``: ``_shexp``
    for a MoE's shared expert); ``act_mul`` is the fused ``act(gate) * up``
    (``gelu_tanh_mul`` for Gemma, ``silu_mul`` for Llama and Qwen)."""

    def __init__(self, layer: int, w, backend: Backend, act_mul, suffix: str = ""):
        super().__init__()
        p = f"blk.{layer}."
        self.gate = Linear(w(f"{p}ffn_gate{suffix}.weight"), backend)
        self.up = Linear(w(f"{p}ffn_up{suffix}.weight"), backend)
        self.down = Linear(w(f"{p}ffn_down{suffix}.weight"), backend)
        self.gate_up = Projections(self.gate, self.up)
        self.act_mul = act_mul
        self.cpu_kernel = backend.cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(self.act_mul(gate, up, self.cpu_kernel))


FLOAT_TYPE_NAMES = frozenset(t.name for t in FLOAT_TYPES)


def weight_paths(model: nn.Module) -> dict[str, str]:
    """How the model's matmul weights of each quantized GGUF type are read, by
    type name: "GGUF blocks" (kernels read the file's blocks) or "dense copy
    (N MiB)" (dequantized at load: a type this device's kernels cannot read).
    Float types are left out (dense is their form)."""
    blocks, dense = set(), Counter()
    for m in model.modules():
        if isinstance(m, Linear) and m.source_type not in FLOAT_TYPE_NAMES:
            if m.weight is None:
                blocks.add(m.source_type)
            else:
                dense[m.source_type] += m.weight.numel() * m.weight.element_size()
    out = {name: "GGUF blocks" for name in sorted(blocks - set(dense))}
    out.update({name: f"dense copy ({n / 2**20:.1f} MiB)" for name, n in sorted(dense.items())})
    return out

