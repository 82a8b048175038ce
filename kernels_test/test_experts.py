"""Expert matmuls (``strata_kernels.experts``): a step's routed rows grouped
by expert and multiplied by a 3-D GGUF expert tensor, each expert's matrix
read where it receives rows, against a float64 product of the dequantized
experts, on every backend (Triton through the interpreter) and every type
the CPU kernels read."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from helpers import random_quant_tensor, report_mismatch
from strata_kernels import block_format

from strata_kernels import ExpertGroups, QuantTensor, cpu_kernels, dequantize, expert_matmul, expert_matrix

CPU_TYPES = sorted(cpu_kernels.CPU_KERNEL_TYPES, key=lambda t: t.value)
N_EXPERTS, N, BLOCKS = 5, 12, 2


def _experts(qtype: T, seed: int) -> QuantTensor:
    flat = random_quant_tensor(qtype, N_EXPERTS * N, BLOCKS, seed)
    return QuantTensor(flat.data, qtype, (N_EXPERTS, N, flat.cols))


def _expected(x: torch.Tensor, experts: QuantTensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T, k, N]`` float64: row t times the matrix of each of its k experts."""
    dense = dequantize(experts, torch.float32).reshape(experts.shape).double()
    return torch.einsum("tc,tknc->tkn", x.double(), dense[ids])


ROUTINGS = {
    "odd rows, experts 1 and 3 unused": torch.tensor([[0, 2], [4, 0], [2, 4], [0, 4], [2, 0]]),
    "one expert takes every row": torch.tensor([[3], [3], [3], [3], [3], [3], [3], [3], [3], [3], [3]]),
    "one row, top-4": torch.tensor([[4, 1, 3, 0]]),
    "a prompt's 19 rows, top-2": torch.stack([torch.arange(19) % 5, (torch.arange(19) * 3 + 1) % 5], 1),
    "40 rows, expert 2 takes every one": torch.stack([torch.full((40,), 2), torch.tensor([0, 1, 3, 4] * 10)], 1),
}


@pytest.mark.parametrize("qtype", CPU_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("routing", list(ROUTINGS), ids=lambda r: r.replace(" ", "-").replace(",", ""))
@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.cpu_kernels), "triton"])
def test_expert_matmul_equals_each_rows_experts(qtype, routing, backend):
    ids = ROUTINGS[routing]
    experts = _experts(qtype, seed=qtype.value)
    x = torch.randn(ids.shape[0], experts.shape[2], generator=torch.Generator().manual_seed(ids.shape[0]))
    groups = ExpertGroups.of(ids, N_EXPERTS)
    assert set(groups.experts) == set(ids.unique().tolist())
    got = expert_matmul(x[groups.rows], experts, groups, backend)
    expected = _expected(x, experts, ids).reshape(-1, N)[groups.order]
    tol = 1e-3 * expected.abs().max() + 1e-4
    assert torch.allclose(got.double(), expected, atol=float(tol)), report_mismatch(got, expected.float(),
                                                                                 float(tol))


@pytest.mark.parametrize("qtype", [T.IQ4_XS, T.IQ3_S, T.IQ2_XXS, T.Q3_K, T.Q2_K], ids=lambda t: t.name)
def test_triton_reads_the_types_only_it_reads(qtype):
    """Triton reads every GGUF type the dense kernels do, experts included."""
    ids = ROUTINGS["a prompt's 19 rows, top-2"][:9]
    flat = random_quant_tensor(qtype, N_EXPERTS * N, 1, qtype.value)
    experts = QuantTensor(flat.data, qtype, (N_EXPERTS, N, flat.cols))
    x = torch.randn(ids.shape[0], experts.shape[2], generator=torch.Generator().manual_seed(2))
    groups = ExpertGroups.of(ids, N_EXPERTS)
    got = expert_matmul(x[groups.rows], experts, groups, "triton")
    expected = _expected(x, experts, ids).reshape(-1, N)[groups.order]
    tol = 1e-3 * expected.abs().max() + 1e-4
    assert torch.allclose(got.double(), expected, atol=float(tol)), report_mismatch(got, expected.float(),
                                                                                 float(tol))


def test_groups_sort_pairs_by_expert_keeping_row_order():
    ids = torch.tensor([[2, 0], [0, 2], [1, 2]])
    g = ExpertGroups.of(ids, 4)
    assert g.experts == (0, 1, 2) and g.offsets == (0, 2, 3, 6)
    assert g.order.tolist() == [1, 2, 4, 0, 3, 5]  # flat pairs t * k + slot, by expert, rows in order
    assert g.rows.tolist() == [0, 1, 2, 0, 1, 2]


def test_bad_routing_is_clear():
    experts = _experts(T.Q8_0, 1)
    with pytest.raises(ValueError, match="routing names expert 7 of 5"):
        ExpertGroups.of(torch.tensor([[7]]), N_EXPERTS)
    with pytest.raises(ValueError, match="an expert tensor is 3-D"):
        expert_matrix(expert_matrix(experts, 0), 0)
    g = ExpertGroups.of(torch.tensor([[1, 2]]), N_EXPERTS)
    with pytest.raises(ValueError, match=r"x must be \[2, K\]"):
        expert_matmul(torch.randn(3, experts.shape[2]), experts, g)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cpu_call_for_all_experts_equals_one_gemv_each(dtype):
    """``cpu_kernels.gemv_experts`` (every expert's few rows in one parallel
    region) gives each run the bits of a GEMV call of its own."""
    experts = _experts(T.Q5_0, seed=3)
    x = torch.randn(13, experts.shape[2], generator=torch.Generator().manual_seed(1)).to(dtype)
    runs = [(4, 0, 3), (0, 3, 8), (2, 11, 1), (4, 12, 1)]  # an expert may take two runs
    y = cpu_kernels.gemv_experts(x, experts, runs)
    for e, start, count in runs:
        alone = cpu_kernels.gemv(x[start:start + count].float(), expert_matrix(experts, e))  # bf16 x: exact in f32
        assert torch.equal(y[start:start + count], alone), (e, start, count)
    with pytest.raises(RuntimeError, match="each expert takes 1 to 8 consecutive rows"):
        cpu_kernels.gemv_experts(x, experts, [(0, 0, 9)])
    with pytest.raises(RuntimeError, match="expert 5 of 5"):
        cpu_kernels.gemv_experts(x, experts, [(5, 0, 1)])


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_expert_matmul_at_a_real_shape(qtype, m, dtype):
    """128 experts of 768x2048, top-8 (a Qwen3-MoE layer's gate or up): the
    compiled grouped GEMV (m 1, 8) and GEMM (512) against float64."""
    flat = random_quant_tensor(qtype, 128 * 768, 2048 // block_format(qtype).block_size, seed=m)
    experts = QuantTensor(flat.data, qtype, (128, 768, 2048)).to("cuda")
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(m)])
    x = torch.randn(m, 2048, generator=g)
    groups = ExpertGroups.of(ids.cuda(), 128)
    got = expert_matmul(x.cuda().to(dtype)[groups.rows], experts, groups).cpu()
    dense = dequantize(experts.to("cpu"), torch.float32).reshape(128, 768, 2048).double()
    expected = torch.einsum("tc,tknc->tkn", x.to(dtype).double(), dense[ids]).reshape(-1, 768)[groups.order.cpu()]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    err = float(((got.double() - expected).abs() / (expected.abs() + 1)).max())
    assert err < tol, err
