// The CPU kernels' entry points, bound to Python in bindings.cpp and
// wrapped by strata_kernels/cpu_kernels.py (which states each contract).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace strata_cpu {

constexpr int kMaxM = 8;  // rows of x one GEMV pass handles

// qdot_cpu.cpp: y_i = x @ W_i.T for GGUF blocks W_i and 1..kMaxM rows of x,
// by integer dot products against 16-bit codes of x.
std::vector<torch::Tensor> gemv(torch::Tensor x, std::vector<torch::Tensor> blocks, std::vector<int64_t> qtypes,
                                int64_t K);
// dequant_cpu.cpp: GGUF blocks into a dense tensor, bit-exact with gguf-py.
void dequantize(torch::Tensor blocks, int64_t qtype, int64_t K, torch::Tensor out);

// decode_cpu.cpp: the small operations of a decode step.
torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> weight, double eps,
                       std::optional<torch::Tensor> residual, std::optional<torch::Tensor> cos,
                       std::optional<torch::Tensor> sin);
torch::Tensor attention_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t position,
                               std::optional<int64_t> window, double scale, std::optional<torch::Tensor> new_k,
                               std::optional<torch::Tensor> new_v);
torch::Tensor gated_mul(torch::Tensor gate, torch::Tensor up, int64_t act);

}  // namespace strata_cpu
