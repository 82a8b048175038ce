"""The tile settings of every kernel, in one place (``launch_plans`` turns
them into each Triton kernel's constants and warps; ``backends`` chooses
which implementation runs)."""

from __future__ import annotations

from dataclasses import dataclass

# qmatmul: at most this many rows of x take the GEMV path (weights unpacked in
# registers, products reduced per row); more take the GEMM path (dequantized
# tiles into tl.dot). Not yet measured (no GPU so far): 8 is the GEMV's own row
# cap. `python bench/kernels.py --crossover` on the target GPU prints the M up
# to which the GEMV wins per type and the value to set here.
GEMV_MAX_M = 8

# qmatmul on the CPU kernels (backend="cpu"): at most this many rows of x go
# through the GEMV that reads each block once; more take a bfloat16 (or
# float32) copy of a slab of weight rows into torch's GEMM. bench/cpu_matmul.py
# on 2 cores: at M=8 the GEMV still beats the slab on every weight of the
# default model (ffn_down 0.31 against 0.52 ms, attn_q 0.14 against 0.33), so
# the limit is the GEMV's own (it is compiled for 1..8 rows), not a crossover.
CPU_GEMV_MAX_M = 8
# Weight rows dequantized at a time on the CPU GEMM side (bounds the temporary:
# 16384 rows of 640 bf16 values are 21 MB).
CPU_SLAB_ROWS = 16384


@dataclass(frozen=True)
class Launch:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_settings(op: str, m: int, n: int, k: int, block_size: int) -> Launch:
    """Tile sizes and warps for ``op`` in {"dequantize", "gemv", "gemm"} on an
    ``[m, k] x [n, k]^T`` problem whose weights come in blocks of ``block_size``."""
    if n < 1 or k < 1 or m < 0:
        raise ValueError(f"sizes must be positive, got M={m}, N={n}, K={k}")
    if k % block_size:
        raise ValueError(f"K={k} is not a multiple of the block size {block_size}")
    if n * k >= 2**40:
        raise ValueError(f"a {n}x{k} weight is beyond what these kernels index (2**40 elements)")
    # One tile of K spans whole blocks: a 256-weight super-block, or 4 small
    # blocks (the GEMV's narrows for more rows, in whole sub-blocks). Not
    # narrowed for a small K (the kernels mask past K): every width of a
    # type shares one compiled kernel, here and in the compile test.
    block_k = 256 if block_size == 256 else 128
    if op == "dequantize":
        return Launch(1, 16, block_k, 4)
    if op == "gemv":
        if m > GEMV_MAX_M:
            raise ValueError(f"the GEMV path takes at most {GEMV_MAX_M} rows, got {m}")
        block_m = _pow2_at_least(max(1, m))
        # The GEMV holds BLOCK_M x BLOCK_N x BLOCK_K products in registers
        # (8 x 16 x 256 took all 255 registers on sm_80 and spilled), so the K
        # tile narrows as rows are added: at most 64 products per thread.
        # (8 warps halve the registers but made ptxas spill in other types:
        # bench/kernel_report.py shows each setting's registers and spills.)
        return Launch(block_m, 16, min(block_k, max(64, 256 // block_m)), 4)
    if op == "gemm":
        # 8 warps: each thread holds half as much of the dequantized [64, 64]
        # weight tile and its gather addresses (4 warps spilled 200-900 bytes
        # in every type on sm_86 and sm_90; 8 spill none in most).
        return Launch(min(64, max(16, _pow2_at_least(m))), 64, 64, 8)
    raise ValueError(f"unknown op {op!r}")


def gemv_words_settings(m: int) -> Launch:
    """The word-planes GEMV (``_triton_gemv_words``): each thread loads 16
    bytes of a row (a chunk of 4 words) and holds its partial sums; a CTA
    covers BLOCK_N rows by BLOCK_K chunks per iteration. At one row of x, 32
    rows a CTA halve the loop's instructions per byte against 16
    (``bench/bandwidth_check.py``: Q8_0 61 against 107 a KiB on sm_90), and
    16 chunks a row an iteration take 10-20% fewer than 8 (the loop's own
    work and the scales' addresses shared: Q4_K 112 against 101, Q8_0 61
    against 49); more rows of x keep 16 rows and 8 chunks, their products
    already filling the registers."""
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"the GEMV path takes 1 to {GEMV_MAX_M} rows, got {m}")
    return Launch(_pow2_at_least(m), 32 if m == 1 else 16, 16 if m == 1 else 8, 4)


def split_k(n_tiles: int, chunks: int, block_c: int, sms: int, per_sm: int = 4) -> int:
    """The word GEMV's splits of K: ``per_sm`` programs per SM over
    ``n_tiles`` row tiles, each split at least one ``block_c`` of a row's
    ``chunks``."""
    want = -(-per_sm * sms // n_tiles)
    return max(1, min(want, chunks // block_c))


@dataclass(frozen=True)
class AttentionLaunch:
    splits: int
    block_m: int
    block_n: int
    num_warps: int


def attention_settings(t: int, group: int, n_slots: int, head_dim: int, programs: int = 1,
                       sms: int = 0) -> AttentionLaunch:
    """Decode (one query): rows are the heads of a group; the context is split
    so that the launch's ``programs`` (sequences x KV heads) times its row
    tiles times the splits make at least 2 programs per SM of a device with
    ``sms`` SMs (0: unknown, as under the interpreter), and at least one split
    per 256 positions (at most 64), each split a whole number of tiles.
    Prefill: query tiles, one pass over the context each."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 512:
        raise ValueError(f"attention kernels need a power-of-two head dim in [16, 512], got {head_dim}")
    if t == 1:
        # Rows are the group's heads, all at once where the tile fits (each
        # program reads its KV once); a group past the cap (64 heads of 128,
        # 32 of 256, 16 of 512) takes several programs, each reading the KV.
        # Warps grow with the [rows, D] float32 accumulator: the tiles stay
        # within the registers and the shared memory of an sm_86 block
        # (bench/kernel_report.py: no spills at these settings).
        cap = 64 if head_dim <= 128 else 32 if head_dim <= 256 else 16
        block_m = min(max(16, _pow2_at_least(group)), cap)
        block_n = 32 if head_dim <= 128 else 16
        row_tiles = -(-group // block_m)
        splits = max(1, min(64, n_slots // 256))
        if sms:  # a 4K context of 8 KV heads is 8 programs a split: 33 splits fill an H200's 132 SMs twice
            splits = max(splits, -(-2 * sms // (programs * row_tiles)))
        splits = max(1, min(splits, -(-n_slots // block_n)))
        return AttentionLaunch(splits, block_m, block_n, max(4, min(8, block_m * head_dim // 1024)))
    return AttentionLaunch(1, 64 if head_dim <= 128 else 32 if head_dim <= 256 else 16,
                           64 if head_dim <= 64 else 32 if head_dim <= 256 else 16, 4 if head_dim <= 32 else 8)
