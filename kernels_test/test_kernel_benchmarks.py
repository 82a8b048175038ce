"""Kernel microbenchmarks as pytest-benchmark tests.

Each times one kernel on one shape and checks its result against a reference
computed another way; none asserts anything about time. On the CPU (part of
every run) they take two rounds each on small shapes: they prove the
benchmarks run and stay correct. On a GPU (``pytest -m gpu``) the same
kernels run at the sizes of real models with enough rounds to time them; a
GPU runner keeps the JSON and compares it with its previous run:

    pytest -m gpu kernels_test/test_kernel_benchmarks.py --benchmark-autosave \\
        --benchmark-compare --benchmark-compare-fail=min:15%

(``.github/workflows/gpu.yml``). ``extra_info`` carries the bytes each call
reads, for GB/s against the device's copy bandwidth.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from helpers import random_quant_tensor

from strata_kernels import ExpertGroups, KVStore, QuantTensor, attention, dequantize, expert_matmul, kv_write, qmatmul
from strata_kernels.formats import block_format
from strata_kernels.recurrent import delta_rule_prefill, delta_rule_recurrent, delta_rule_step

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)


def _timed(benchmark, device: str, fn):
    """Run ``fn`` under the benchmark: two rounds on the CPU (the run is the
    check), enough on a GPU to time it (synchronized: GPU work is async)."""
    if device == "cpu":
        return benchmark.pedantic(fn, rounds=2, warmup_rounds=0, iterations=1)

    def synced():
        out = fn()
        torch.cuda.synchronize()
        return out

    return benchmark.pedantic(synced, rounds=30, warmup_rounds=3, iterations=1)


def _backend(device: str) -> str:
    return "cpu" if device == "cpu" else "auto"  # the compiled CPU kernels; Triton on CUDA


# --- qmatmul ------------------------------------------------------------------

QMATMUL = {  # device -> (types, N x K, rows of x)
    "cpu": ([T.Q4_K, T.Q8_0, T.Q6_K, T.Q4_0], (2048, 1024), (1, 16)),
    "cuda": ([T.Q4_K, T.Q8_0, T.IQ4_XS, T.IQ3_S, T.Q6_K], (14336, 4096), (1, 8, 512)),
}


def _qmatmul_cases():
    for device in (CPU, CUDA):
        types, _, rows = QMATMUL[device.values[0]]
        for qtype in types:
            for m in rows:
                yield pytest.param(*device.values, qtype, m, id=f"{device.id}-{qtype.name}-M{m}", marks=device.marks)


@pytest.mark.parametrize("device,qtype,m", list(_qmatmul_cases()))
def test_qmatmul(benchmark, device, qtype, m):
    n, k = QMATMUL[device][1]
    qt = random_quant_tensor(qtype, n, k // block_format(qtype).block_size, seed=1).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    if device == "cuda":
        x = x.bfloat16()
    benchmark.extra_info.update(bytes_read=qt.nbytes, m=m, n=n, k=k)
    out = _timed(benchmark, device, lambda: qmatmul(x, qt, backend=_backend(device)))
    expected = x.float() @ dequantize(qt, torch.float32).T
    scale = expected.abs().max().item()
    assert out.shape == (m, n) and (out.float() - expected).abs().max().item() <= 0.02 * scale


# --- attention and quantize-on-write ------------------------------------------

ATTENTION = {"cpu": (1, 4, 256, 4096), "cuda": (8, 4, 128, 32768)}  # KV heads, group, head dim, context


def _filled(fmt: str, device: str):
    hkv, group, d, context = ATTENTION[device]
    store = KVStore.allocate(fmt, context, hkv, d, device=device)
    g = torch.Generator().manual_seed(3)
    for c0 in range(0, context, 8192):  # in slices to bound the temporaries
        n = min(8192, context - c0)
        x = torch.randn(n, hkv, d, generator=g).to(device)
        kv_write(store, torch.arange(c0, c0 + n, device=device), x, -x)
    q = torch.randn(1, hkv * group, d, generator=g).to(device)
    return store, q, context, d


@pytest.mark.parametrize("fmt", ["f16", "int8", "k8v4"])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_decode_attention(benchmark, device, fmt):
    store, q, context, d = _filled(fmt, device)
    benchmark.extra_info.update(bytes_read=store.nbytes, context=context)
    out = _timed(benchmark, device, lambda: attention(q, store, context - 1, None, d**-0.5, _backend(device)))
    expected = attention(q, store, context - 1, None, d**-0.5, backend="torch")
    assert torch.allclose(out.float(), expected.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("fmt", ["int8", "k8v4"])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_quantize_on_write(benchmark, device, fmt):
    """A prefill chunk's 512 rows written into the cache."""
    hkv, _, d, context = ATTENTION[device]
    store = KVStore.allocate(fmt, context, hkv, d, device=device)
    rows = torch.randn(512, hkv, d, generator=torch.Generator().manual_seed(4)).to(device)
    positions = torch.arange(512, device=device)
    benchmark.extra_info.update(bytes_written=store.nbytes * 512 // context)
    _timed(benchmark, device, lambda: kv_write(store, positions, rows, rows))
    twin = KVStore.allocate(fmt, context, hkv, d, device=device)
    kv_write(twin, positions, rows, rows, backend="torch")
    assert torch.equal(store.k[:512], twin.k[:512]) and torch.equal(store.v[:512], twin.v[:512])


# --- experts --------------------------------------------------------------------

EXPERTS = {"cpu": (16, 256, 512, 2, (1, 8)), "cuda": (128, 768, 2048, 8, (1, 8, 512))}  # E, N, K, top-k, rows


def _expert_cases():
    for device in (CPU, CUDA):
        for m in EXPERTS[device.values[0]][4]:
            yield pytest.param(*device.values, m, id=f"{device.id}-M{m}", marks=device.marks)


@pytest.mark.parametrize("device,m", list(_expert_cases()))
def test_expert_matmul(benchmark, device, m):
    e, n, k, top, _ = EXPERTS[device]
    flat = random_quant_tensor(T.Q4_K, e * n, k // 256, seed=5)
    experts = QuantTensor(flat.data, T.Q4_K, (e, n, k)).to(device)
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(m)]).to(device)
    groups = ExpertGroups.of(ids, e)
    rows = torch.randn(m, k, generator=g).to(device)[groups.rows]
    benchmark.extra_info.update(bytes_read=experts.nbytes * len(groups.experts) // e, m=m)
    out = _timed(benchmark, device, lambda: expert_matmul(rows, experts, groups, _backend(device)))
    expected = expert_matmul(rows.cpu(), experts.to("cpu"), ExpertGroups.of(ids.cpu(), e), "torch")
    scale = expected.abs().max().item()
    assert (out.float().cpu() - expected).abs().max().item() <= 0.02 * scale


# --- recurrent (Gated DeltaNet) ---------------------------------------------------

RECURRENT = {"cpu": (4, 8, 64, 64, 4, 128), "cuda": (16, 32, 128, 128, 8, 2048)}  # Hk, Hv, Dk, Dv, batch, prompt


def _recurrent_inputs(t: int, hk: int, hv: int, dk: int, dv: int, device: str):
    g = torch.Generator().manual_seed(t)
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1)
    v = torch.randn(t, hv, dv, generator=g)
    decay, beta = -torch.rand(t, hv, generator=g) * 0.1, torch.rand(t, hv, generator=g)
    return [x.to(device) for x in (q, k, v, decay, beta)]


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_delta_rule_decode_step(benchmark, device):
    hk, hv, dk, dv, batch, _ = RECURRENT[device]
    q, k, v, decay, beta = _recurrent_inputs(batch, hk, hv, dk, dv, device)
    state = torch.randn(batch, hv, dk, dv, generator=torch.Generator().manual_seed(6)).to(device) * 0.1
    slots = torch.arange(batch, device=device)
    start = state.clone()
    benchmark.extra_info.update(bytes_read=state.nbytes, batch=batch)
    out = _timed(benchmark, device, lambda: delta_rule_step(q, k, v, decay, beta, state.copy_(start), slots,
                                                            _backend(device)))
    reference = start.clone()
    expected = delta_rule_step(q, k, v, decay, beta, reference, slots, "torch")
    assert torch.allclose(out, expected, atol=1e-4) and torch.allclose(state, reference, atol=1e-4)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_delta_rule_prefill(benchmark, device):
    hk, hv, dk, dv, _, t = RECURRENT[device]
    q, k, v, decay, beta = _recurrent_inputs(t, hk, hv, dk, dv, device)
    state = torch.zeros(hv, dk, dv, device=device)
    benchmark.extra_info.update(tokens=t)
    out = _timed(benchmark, device, lambda: delta_rule_prefill(q, k, v, decay, beta, state.zero_(),
                                                               _backend(device)))
    reference = torch.zeros(hv, dk, dv)
    expected = delta_rule_recurrent(*(x.cpu() for x in (q, k, v, decay, beta)), reference)
    assert torch.allclose(out.cpu(), expected, atol=1e-3) and torch.allclose(state.cpu(), reference, atol=1e-3)
