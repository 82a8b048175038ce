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
// qdot_cpu.cpp: a mixture-of-experts step's GEMVs in one parallel region:
// rows starts[i]..starts[i]+counts[i]-1 of x (at most kMaxM) times expert
// experts[i]'s [N, K] matrix (rows experts[i]*N.. of blocks), into the same
// rows of y [P, N] float32 (rows no expert takes are left unwritten).
torch::Tensor gemv_experts(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t N,
                           std::vector<int64_t> experts, std::vector<int64_t> starts, std::vector<int64_t> counts);
// dequant_cpu.cpp: GGUF blocks into a dense tensor, bit-exact with gguf-py.
void dequantize(torch::Tensor blocks, int64_t qtype, int64_t K, torch::Tensor out);

// decode_cpu.cpp: the small operations of a decode step.
torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> weight, double eps,
                       std::optional<torch::Tensor> residual, std::optional<torch::Tensor> cos,
                       std::optional<torch::Tensor> sin);
torch::Tensor attention_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                               std::optional<int64_t> window, double scale, torch::Tensor tables,
                               torch::Tensor table_lengths, int64_t block_size, std::optional<torch::Tensor> new_k,
                               std::optional<torch::Tensor> new_v);
torch::Tensor gated_mul(torch::Tensor gate, torch::Tensor up, int64_t act);

// decode_block_cpu.cpp: a decoder layer's decode step as two calls of the above.
torch::Tensor attention_block(torch::Tensor x, torch::Tensor norm, double eps, std::vector<torch::Tensor> qkv,
                              std::vector<int64_t> qkv_types, std::vector<torch::Tensor> qkv_bias,
                              std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                              int64_t heads, int64_t kv_heads, int64_t head_dim, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor positions,
                              std::optional<int64_t> window, double scale, torch::Tensor tables,
                              torch::Tensor table_lengths, int64_t block_size, torch::Tensor o, int64_t o_type,
                              std::optional<torch::Tensor> post_norm);
torch::Tensor mlp_block(torch::Tensor x, torch::Tensor norm, double eps, torch::Tensor gate, int64_t gate_type,
                        torch::Tensor up, int64_t up_type, torch::Tensor down, int64_t down_type, int64_t act,
                        std::optional<torch::Tensor> post_norm);

// recurrent_cpu.cpp: a recurrent layer's decode step, one token per sequence.
torch::Tensor delta_rule_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                              torch::Tensor state, torch::Tensor slots);
torch::Tensor delta_rule_scan(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                              torch::Tensor state);
torch::Tensor conv_step(torch::Tensor x, torch::Tensor weight, torch::Tensor conv, torch::Tensor slots);

}  // namespace strata_cpu
