"""Every Triton kernel's launch configurations, in one place.

A launcher asks a function here for its kernel's compile-time constants
(``tl.constexpr`` values) and warps; ``configurations()`` calls the same
functions over every input its launcher can be given and lists each distinct
result, so the ahead-of-time compile test (``kernels_test/test_compile_targets.py``)
and ``bench/kernel_report.py`` compile exactly what a GPU would.

The inputs are bounded by what the runtime passes on CUDA: activations in
bfloat16 (``dtype="auto"``) or float32 (``dtype="float32"``), f16-format KV in
float16, head dims that are powers of two in [16, 512], recurrent key and
value dims up to 256; matrix widths K do not change a kernel's tiles.
Imported by the Triton launchers only (it imports triton).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as T

from ._triton_unpack import HAS_OFFSET, SUB_BLOCK, TRITON_TABLES
from .formats import block_format
from .kv_store import KV_FORMATS
from .launch import GEMV_MAX_M, _pow2_at_least, attention_settings, gemv_words_settings, launch_settings

# Activation dtypes on CUDA: the default path's and dtype="float32"'s.
ACTIVATION_DTYPES = ("bf16", "fp32")
HEAD_DIMS = (16, 32, 64, 128, 256, 512)
FORMAT_CODES = {"f16": 0, "int8": 1, "k8v4": 2}  # the attention kernel's FMT: how it reads each KV format

# Recurrent kernels' fixed tiles.
DELTA_BLOCK_V = 32  # value columns of the state per program
CONV_BLOCK_C = 256  # channels of the convolution per program
CHUNK = 32  # tokens per chunk of the chunked kernel (its [CHUNK, Dk] keys and queries stay in registers)
CHUNK_WARPS = 8
RECURRENT_DIMS = (16, 32, 64, 128, 256)
CONV_WINDOWS = (1, 2, 3, 4)  # a short convolution of 2 to 5 taps keeps taps - 1 inputs


@dataclass(frozen=True)
class KernelLaunch:
    """A kernel's compile-time constants and warps, as its launcher passes them."""

    constexprs: dict
    num_warps: int = 4
    num_stages: int | None = None  # software pipelining stages (None: Triton's default)


@dataclass(frozen=True)
class KernelConfig:
    """One compile of one kernel. Invariant: ``signature`` names every
    argument of ``kernel`` in order, ``"constexpr"`` exactly for the keys of
    ``constexprs``; ``decode`` marks the configuration a decode step uses
    (where spilled registers are a defect)."""

    module: str  # strata_kernels.<module>
    kernel: str
    label: str
    signature: dict = field(hash=False)
    constexprs: dict = field(hash=False)
    num_warps: int = 4
    decode: bool = False
    divisible: tuple = ()  # integer arguments a launch passes as multiples of 16 (the JIT specializes on it)
    num_stages: int | None = None

    @property
    def key(self) -> tuple:
        key = (self.module, self.kernel, tuple(self.signature.items()), tuple(sorted(self.constexprs.items())),
               self.num_warps)
        key = key + (self.divisible,) if self.divisible else key
        return key + (("stages", self.num_stages),) if self.num_stages is not None else key


def triton_dtype(dtype) -> str:
    """Triton's name of a torch float dtype (``torch.bfloat16`` -> ``bf16``)."""
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[str(dtype).removeprefix("torch.")]


# --- what each launcher passes ----------------------------------------------------------

def weight_constants(qtype: int) -> dict:
    """The constants every kernel reading GGUF blocks of ``qtype`` takes."""
    fmt = block_format(T(qtype))
    return dict(QTYPE=int(qtype), BS=fmt.block_size, TS=fmt.type_size, OFFSET=int(qtype) in HAS_OFFSET)


def dequantize_launch(qtype: int, n: int, k: int) -> KernelLaunch:
    s = launch_settings("dequantize", 0, n, k, block_format(T(qtype)).block_size)
    return KernelLaunch(dict(weight_constants(qtype), BLOCK_N=s.block_n, BLOCK_K=s.block_k), s.num_warps)


def gemv_launch(qtype: int, m: int, n: int, k: int) -> KernelLaunch:
    s = launch_settings("gemv", m, n, k, block_format(T(qtype)).block_size)
    return KernelLaunch(dict(weight_constants(qtype), SUB=SUB_BLOCK[int(qtype)], BLOCK_M=s.block_m,
                             BLOCK_N=s.block_n, BLOCK_K=s.block_k), s.num_warps)


# The word GEMV's kernel per type: BITS for _gemv_words_kernel, KIND for _gemv_superblock_kernel.
WORD_KINDS = {T.Q4_K: 2, T.Q5_K: 3, T.Q6_K: 4, T.IQ4_XS: 5, T.Q4_1: 6, T.Q5_0: 7, T.Q5_1: 8}
# Kinds 6-8 are superblocks of one chunk (word_planes.WordType.unit_min); 3, 7 and 8 have Q5_K's high word.
# The grid types' GEMV and dequantization (_triton_gemv_grid): their KIND.
GRID_KINDS = {T.IQ3_S: 0, T.IQ2_XXS: 1}
GRID_BLOCK_C = 8  # chunks of 32 weights a tile takes an iteration: a superblock (42.75 instructions a chunk of IQ3_S
# on sm_90 against 47.75 at 4 and 61 at 2; at 8 rows of x 53 against 64)


def gemv_words_launch(qtype: int, m: int, block_n: int | None = None, block_c: int | None = None,
                      num_warps: int | None = None) -> KernelLaunch:
    """The word-planes GEMV (``_triton_gemv_words``) for ``m`` rows of x
    (tiles as ``launch.gemv_words_settings`` says, unless given)."""
    from .word_planes import WORD_TYPES

    s = gemv_words_settings(m)
    if T(qtype) in GRID_KINDS:  # a tile's chunks are of 32 weights here (of 4 code words in the others)
        kind, tile = {"KIND": GRID_KINDS[T(qtype)]}, GRID_BLOCK_C
    elif T(qtype) in WORD_KINDS:  # Q6_K keeps 8 chunks: its two high words a chunk spill at 16 (sm_86)
        kind, tile = {"KIND": WORD_KINDS[T(qtype)]}, min(s.block_k, 8) if T(qtype) == T.Q6_K else s.block_k
    else:
        kind, tile = {"BITS": WORD_TYPES[T(qtype)].bits}, s.block_k
    return KernelLaunch(dict(kind, BLOCK_M=s.block_m, BLOCK_N=block_n or s.block_n,
                             BLOCK_C=block_c or tile, USE_ASM=True), num_warps or s.num_warps)


def gemv_words_config(qtype: int, m: int, **tiles) -> KernelConfig:
    launch = gemv_words_launch(qtype, m, **tiles)
    pointers = {"xw": "*i32", "xmeta": "*fp32", "quants": "*i32", "out": "*fp32", "groups": "*i32"}
    label = _label(f"{T(qtype).name} words", launch, "i16")
    if T(qtype) in GRID_KINDS:
        pointers.update({"high_words": "*i32", "sub": "*i16", "supers": "*i32", "grid": "*i32"})
        config = _config("_triton_gemv_grid", "_gemv_grid_kernel", label, launch, pointers, decode=True)
    elif T(qtype) in WORD_KINDS:
        pointers.update({"high_words": "*i32", "sub": "*i16", "supers": "*i32"})
        config = _config("_triton_gemv_words", "_gemv_superblock_kernel", label, launch, pointers, decode=True)
    else:
        pointers["scales"] = "*fp16"
        config = _config("_triton_gemv_words", "_gemv_words_kernel", label, launch, pointers, decode=True)
    # A row's words and the planes' strides are multiples of 16 for every K a model has (K % 512 == 0).
    return dataclasses.replace(config, divisible=("WPR",))


# The tensor-core GEMV (_triton_gemv_mma) for a decode step's 2-8 rows: its KIND per type.
MMA_KINDS = {T.Q8_0: 0, T.Q4_0: 1, **WORD_KINDS}


def gemv_mma_launch(qtype: int) -> KernelLaunch:
    """64 rows by 8 blocks of 32 weights a step, two warps: each warp's 32 rows
    are its own (four warps over 32 rows converted every weight twice: 187
    against 111 instructions per KiB of Q8_0 on sm_90), two tiles of 16 rows
    sharing each load of x (32 rows a warp: 120 against 115 for Q4_0, 133
    against 125 for Q4_K, 153 against 143 for Q5_K, 132 against 125 for
    Q6_K; up to 200 registers, no spills)."""
    # Two pipeline stages: three took twice the shared memory and no fewer instructions (sm_86 occupancy
    # 0.08 against 0.21 for Q8_0); one took more registers and, for Q4_K, more instructions.
    return KernelLaunch({"KIND": MMA_KINDS[T(qtype)], "BLOCK_N": 64, "BLOCK_B": 8, "USE_ASM": True}, 2, 2)


def gemv_mma_config(qtype: int) -> KernelConfig:
    launch = gemv_mma_launch(qtype)
    superblocks = T(qtype) in WORD_KINDS
    pointers = {"xt": "*fp16", "xscale": "*fp32", "xsums": "*fp16",
                "quants": "*i8" if T(qtype) == T.Q8_0 else "*u8", "high_words": "*i32",
                "scales": "*i32" if superblocks else "*fp16", "sub": "*i16" if superblocks else "*i32",
                "supers": "*i32", "codebook": "*i32", "word_table": "*i32", "out": "*fp32"}
    config = _config("_triton_gemv_mma", "_gemv_mma_kernel", _label(f"{T(qtype).name} mma", launch, "f16"),
                     launch, pointers, decode=True)
    # KB (blocks of 32 a row) is a multiple of 16 for every K a model has (K % 512 == 0): the JIT specializes on
    # it, and a row's high words are then aligned for 16-byte copies
    return dataclasses.replace(config, divisible=("KB",))


# The planes' dequantization (_triton_planes_dequant): its KIND per type, rows and blocks of 32 per program.
PLANES_KINDS = {T.Q8_0: 0, T.Q4_0: 1, **WORD_KINDS}


def planes_dequant_launch(qtype: int) -> KernelLaunch:
    return KernelLaunch({"KIND": PLANES_KINDS[T(qtype)], "BLOCK_N": 16, "BLOCK_B": 8}, 4)


def grid_dequant_launch(qtype: int) -> KernelLaunch:
    return KernelLaunch({"KIND": GRID_KINDS[T(qtype)], "BLOCK_N": 16, "BLOCK_B": 4}, 4)


def planes_dequant_config(qtype: int, dtype: str) -> KernelConfig:
    """Dequantizing a weight's planes into a ``dtype`` matrix (a prompt's matmul)."""
    if T(qtype) in GRID_KINDS:
        launch = grid_dequant_launch(qtype)
        pointers = {"quants": "*i32", "high_words": "*i32", "sub": "*i16", "supers": "*i32", "grid": "*i32",
                    "out": f"*{dtype}"}
        return _config("_triton_gemv_grid", "_dequantize_grid_kernel",
                       _label(f"{T(qtype).name} planes", launch, dtype), launch, pointers)
    launch = planes_dequant_launch(qtype)
    superblocks = T(qtype) in WORD_KINDS
    pointers = {"quants": "*i8" if T(qtype) == T.Q8_0 else "*u8", "scales": "*i32" if superblocks else "*fp16",
                "high_words": "*i32", "sub": "*i16" if superblocks else "*i32", "supers": "*i32",
                "levels": "*fp32", "out": f"*{dtype}"}
    return _config("_triton_planes_dequant", "_dequantize_planes_kernel", _label(f"{T(qtype).name} planes", launch,
                   dtype), launch, pointers)


def gemm_launch(qtype: int, m: int, n: int, k: int, activations: str) -> KernelLaunch:
    """``activations``: the Triton dtype name of x. Float32 inputs keep full
    precision (no TF32); half types use the tensor cores as they are."""
    s = launch_settings("gemm", m, n, k, block_format(T(qtype)).block_size)
    return KernelLaunch(dict(weight_constants(qtype), BLOCK_M=s.block_m, BLOCK_N=s.block_n, BLOCK_K=s.block_k,
                             DOT_PRECISION="ieee" if activations == "fp32" else "tf32"), s.num_warps)


def attention_launch(t: int, group: int, n_slots: int, head_dim: int, fmt: str, programs: int = 1, sms: int = 0):
    """The attention kernel's constants and its split count (a run-time
    argument: ``launch.attention_settings`` says how ``programs`` and ``sms``
    set it)."""
    s = attention_settings(t, group, n_slots, head_dim, programs, sms)
    warps, block_n, splits = s.num_warps, s.block_n, s.splits
    if t == 1 and fmt != "f16" and head_dim <= 256:
        # A quantized position is half or a quarter of f16's bytes: 64 positions a step keep the step's
        # softmax and bookkeeping from outweighing the reads (bandwidth_check, instructions a KiB on sm_86:
        # int8 247 -> 211 at D=128, 236 -> 180 at D=256; k8v4 312 -> 281, 451 -> 276). 128 cut them further
        # but took 132 KB of shared memory (k8v4, D=256), spilled (int8, D=256, sm_90), left a 4K context too
        # few splits for 2 programs an SM, and lowered occupancy more than it saved.
        block_n = 64
        splits = max(1, min(splits, -(-n_slots // block_n)))
        if head_dim == 256:  # 4 warps spilled 12-108 bytes (int8, float32 queries); 8 spill none
            warps = max(warps, 8)
    if t == 1 and fmt == "k8v4":  # its values' levels and regrouped halves take twice the registers per tile
        warps = max(warps, min(8, s.block_m * head_dim // 512))
    return KernelLaunch(dict(D=head_dim, FMT=FORMAT_CODES[fmt], BLOCK_M=s.block_m, BLOCK_N=block_n,
                             ONE_QUERY=t == 1, USE_ASM=True), warps), splits


def merge_launch(head_dim: int) -> KernelLaunch:
    """The attention splits' merge: 16 splits' rows a step."""
    return KernelLaunch({"D": head_dim, "BLOCK_S": 16}, 4)


def kv_quantize_launch(head_dim: int, group: int, bits: int, n_candidates: int) -> KernelLaunch:
    return KernelLaunch(dict(D=head_dim, GROUP=group, BITS=bits, N_CANDIDATES=n_candidates,
                             CANDIDATES=_pow2_at_least(n_candidates)))


def delta_rule_step_launch(d_k: int) -> KernelLaunch:
    """A program holds a [Dk, BLOCK_V] float32 tile of the state: 8 warps
    past Dk = 128 keep it in registers (4 spilled at 256)."""
    return KernelLaunch(dict(BLOCK_K=_pow2_at_least(d_k), BLOCK_V=DELTA_BLOCK_V), 4 if d_k <= 128 else 8)


def conv_step_launch(window: int) -> KernelLaunch:
    return KernelLaunch(dict(W=window, BLOCK_C=CONV_BLOCK_C))


def delta_rule_chunk_launch(d_k: int, d_v: int) -> KernelLaunch:
    return KernelLaunch(dict(CHUNK=CHUNK, BLOCK_K=max(16, _pow2_at_least(d_k)),
                             BLOCK_V=min(DELTA_BLOCK_V, max(16, _pow2_at_least(d_v)))), CHUNK_WARPS)


# --- every configuration ------------------------------------------------------------------

_TABLES = {"grid_ptr": "*u8", "signs_ptr": "*u8", "values_ptr": "*u8"}
_ROUTING = {"experts": "*i32", "starts": "*i32", "counts": "*i32",  # the expert kernels' run tables
            "tile_experts": "*i32", "tile_starts": "*i32", "tile_counts": "*i32"}
_K = 4096  # the tiles do not depend on K (launch_settings)
_N = 4096


def _signature(arg_names: list[str], launch: KernelLaunch, pointers: dict, scalars: dict | None = None) -> dict:
    """Every argument: ``constexpr``, its pointer type, or its scalar type
    (``i32`` unless ``scalars`` says otherwise: Triton passes an int that fits
    in 32 bits as i32)."""
    out = {}
    for name in arg_names:
        if name in launch.constexprs:
            out[name] = "constexpr"
        elif name in pointers:
            out[name] = pointers[name]
        else:
            out[name] = (scalars or {}).get(name, "i32")
    return out


def _arg_names(module: str, kernel: str) -> list[str]:
    import importlib

    return importlib.import_module(f"strata_kernels.{module}").__dict__[kernel].arg_names


def _config(module: str, kernel: str, label: str, launch: KernelLaunch, pointers: dict, decode: bool = False,
            scalars: dict | None = None) -> KernelConfig:
    return KernelConfig(module, kernel, label, _signature(_arg_names(module, kernel), launch, pointers, scalars),
                        dict(launch.constexprs), launch.num_warps, decode, num_stages=launch.num_stages)


def _label(name: str, launch: KernelLaunch, dtype: str) -> str:
    """The type, the tile constants and the activations' dtype."""
    tiles = " ".join(f"{k}={v}" for k, v in launch.constexprs.items() if k.startswith("BLOCK_"))
    return f"{name} {tiles} {dtype}"


def gemv_config(qtype: int, m: int, n: int, k: int, dtype: str, decode: bool = True) -> KernelConfig:
    """The GEMV's configuration for ``[m, k] x [n, k]^T`` with ``dtype`` activations."""
    launch = gemv_launch(qtype, m, n, k)
    act = {"x": f"*{dtype}", "out": f"*{dtype}", "blocks": "*u8", **_TABLES}
    return _config("_triton_qmatmul", "_gemv_kernel", _label(T(qtype).name, launch, dtype), launch, act, decode=decode)


def attention_config(fmt: str, head_dim: int, t: int, group: int, n_slots: int,
                     dtype: str, programs: int = 1, sms: int = 0) -> tuple[KernelConfig, int]:
    """The attention kernel's configuration for ``t`` queries of ``group``
    heads per KV head over ``n_slots`` positions, and its split count
    (``programs`` sequences x KV heads on ``sms`` SMs)."""
    k_type = {"f16": "*fp16", "int8": "*i8", "k8v4": "*i8"}[fmt]
    v_type = {"f16": "*fp16", "int8": "*i8", "k8v4": "*u8"}[fmt]
    scales = "*fp16"  # a float16 placeholder where the format has none
    pointers = {"q": f"*{dtype}", "k": k_type, "v": v_type, "k_scales": scales, "v_scales": scales,
                "table": "*i32", "table_lengths": "*i32", "starts": "*i64",
                "part_acc": "*fp32", "part_ml": "*fp32"}
    launch, splits = attention_launch(t, group, n_slots, head_dim, fmt, programs, sms)
    label = f"{fmt} D={head_dim} {'decode' if t == 1 else 'prefill'} " + _label("", launch, dtype).strip()
    return _config("_triton_attention", "_attention_kernel", label, launch, pointers, decode=t == 1,
                   scalars={"scale": "fp32"}), splits


def _weight_configs(dtypes) -> list[KernelConfig]:
    out = []
    for qtype in TRITON_TABLES:
        name = T(qtype).name
        for dt in dtypes:
            act = {"x": f"*{dt}", "out": f"*{dt}", "blocks": "*u8", **_TABLES}
            launch = dequantize_launch(qtype, _N, _K)
            out.append(_config("_triton_dequant", "_dequantize_kernel", _label(name, launch, dt), launch,
                               {"blocks": "*u8", "out": f"*{dt}", **_TABLES}))
            for m in range(1, GEMV_MAX_M + 1):
                launch = gemv_launch(qtype, m, _N, _K)
                label = _label(name, launch, dt)
                out.append(gemv_config(qtype, m, _N, _K, dt, decode=m == 1))
                out.append(_config("_triton_qmatmul", "_expert_gemv_kernel", label, launch, {**act, **_ROUTING},
                                   decode=m == 1))
            for m in (16, 32, 64):
                launch = gemm_launch(qtype, m, _N, _K, dt)
                label = _label(name, launch, dt)
                out.append(_config("_triton_qmatmul", "_gemm_kernel", label, launch, act))
                out.append(_config("_triton_qmatmul", "_expert_gemm_kernel", label, launch, {**act, **_ROUTING}))
    return out


def _attention_configs(dtypes) -> list[KernelConfig]:
    out = []
    for fmt in KV_FORMATS:
        # The quantized formats hold head dims of 64 and up (kv_store: a scale per 64 values).
        for d in (HEAD_DIMS if fmt == "f16" else [h for h in HEAD_DIMS if h >= 64]):
            for dt in dtypes:
                # (A rotated store's queries arrive in float32 whatever the
                # activations: the fp32 configurations cover them.)
                shapes = [(1, g, 8192) for g in (1, 2, 4, 8, 16, 32, 64)] + [(512, 4, 8192)]
                for t, group, n_slots in shapes:
                    out.append(attention_config(fmt, d, t, group, n_slots, dt)[0])
    for d in HEAD_DIMS:
        out.append(_config("_triton_attention", "_merge_splits_kernel", f"merge D={d}", merge_launch(d),
                           {"part_acc": "*fp32", "part_ml": "*fp32", "out": "*fp32"}))
    return out


def _kv_quantize_configs(dtypes) -> list[KernelConfig]:
    from .kv_store import INT4_BLOCK, INT8_GROUP
    from .reference_kv import nf4_scale_candidates

    out = []
    for d in HEAD_DIMS:
        for dt in dtypes:
            for bits, group, codes in ((8, INT8_GROUP, "*i8"), (4, INT4_BLOCK, "*u8")):
                if d % group:
                    continue
                launch = kv_quantize_launch(d, group, bits, nf4_scale_candidates().numel())
                pointers = {"x": f"*{dt}", "slots": "*i64", "codes": codes, "scales": "*fp16", "levels": "*fp32",
                            "candidates": "*fp32"}
                out.append(_config("_triton_kv_quant", "_quantize_kernel", f"int{bits} D={d} {dt}", launch, pointers,
                                   decode=True))
    return out


def _recurrent_configs() -> list[KernelConfig]:
    floats = {name: "*fp32" for name in ("q", "k", "v", "g", "beta", "state", "out", "x", "taps", "conv")}
    floats["slots"] = "*i64"
    out = []
    for d_k in RECURRENT_DIMS:
        out.append(_config("_triton_recurrent", "_delta_rule_step_kernel", f"Dk={d_k}", delta_rule_step_launch(d_k),
                           floats, decode=True))
        for d_v in RECURRENT_DIMS:
            launch = delta_rule_chunk_launch(d_k, d_v)
            out.append(_config("_triton_recurrent", "_delta_rule_chunk_kernel", f"Dk={d_k} Dv={d_v}", launch, floats))
    for w in CONV_WINDOWS:
        out.append(_config("_triton_recurrent", "_conv_step_kernel", f"W={w}", conv_step_launch(w), floats,
                           decode=True))
    return out


def _word_configs(dtypes) -> list[KernelConfig]:
    from .word_planes import WORD_TYPES

    # A decode step's 2-8 rows of the tensor-core GEMV's types run it, not the word GEMV (qmatmul.gemv_path).
    return ([gemv_words_config(int(qtype), m) for qtype in WORD_TYPES
             for m in range(1, 2 if qtype in MMA_KINDS else GEMV_MAX_M + 1)]
            + [gemv_mma_config(int(qtype)) for qtype in MMA_KINDS]
            + [planes_dequant_config(int(qtype), dtype) for qtype in WORD_TYPES for dtype in dtypes])


def configurations(dtypes=ACTIVATION_DTYPES) -> list[KernelConfig]:
    """Every distinct configuration of every Triton kernel its launcher can
    choose for activations in ``dtypes``, each once, in a stable order."""
    seen, out = set(), []
    for config in (_weight_configs(dtypes) + _word_configs(dtypes) + _attention_configs(dtypes)
                   + _kv_quantize_configs(dtypes) + _recurrent_configs()):
        if config.key not in seen:
            seen.add(config.key)
            out.append(config)
    return out
