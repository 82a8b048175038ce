// A decoder layer's decode step in two calls: the attention half and the
// MLP half, each composed of the kernels a step would otherwise call one by
// one from Python (RMSNorm, the GEMV, RoPE, the one-query attention, the
// gated activation), in the same order and arithmetic, so the result equals
// the unfused path's bit for bit. At decode sizes the Python between those
// calls cost as much as the attention (SmolLM2: about 110 us a layer).
//
// One shape covers the pre-norm families (Llama, Qwen 2 and 3) and Gemma's
// sandwich norms: optional q/k/v biases, optional per-head q/k norms (applied
// with the rotation, as rms_norm does), and an optional post-norm that is
// applied to the half's output before the residual add.

#include "cpu_kernels.h"

namespace strata_cpu {
namespace {

// residual + post_norm(y) with a post-norm, residual + y without.
torch::Tensor add_residual(const torch::Tensor& y, const torch::Tensor& residual,
                           const std::optional<torch::Tensor>& post_norm, double eps) {
  if (post_norm) return rms_norm(y.contiguous(), post_norm, eps, residual, std::nullopt, std::nullopt);
  return residual + y;
}

}  // namespace

torch::Tensor attention_block(torch::Tensor x, torch::Tensor norm, double eps, std::vector<torch::Tensor> qkv,
                              std::vector<int64_t> qkv_types, std::vector<torch::Tensor> qkv_bias,
                              std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                              int64_t heads, int64_t kv_heads, int64_t head_dim, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor positions,
                              std::optional<int64_t> window, double scale, torch::Tensor tables,
                              torch::Tensor table_lengths, int64_t block_size, torch::Tensor o, int64_t o_type,
                              std::optional<torch::Tensor> post_norm) {
  TORCH_CHECK(x.dim() == 2, "attention_block takes one position per sequence: x [B, hidden]");
  const int64_t B = x.size(0);
  TORCH_CHECK(qkv.size() == 3 && qkv_types.size() == 3 && (qkv_bias.empty() || qkv_bias.size() == 3),
              "give the q, k and v weights (and biases, or none)");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "give both q and k norms, or neither");
  const torch::Tensor h = rms_norm(x, norm, eps, std::nullopt, std::nullopt, std::nullopt);
  std::vector<torch::Tensor> p = gemv(h, qkv, qkv_types, x.size(1));
  for (size_t i = 0; i < qkv_bias.size(); ++i) p[i] = p[i] + qkv_bias[i].to(p[i].scalar_type());
  // The rotation (after the per-head norm, where the family has one).
  const torch::Tensor q = rms_norm(p[0].reshape({B, heads, head_dim}), q_norm, q_norm ? eps : 0.0, std::nullopt, cos,
                                   sin);
  const torch::Tensor k = rms_norm(p[1].reshape({B, kv_heads, head_dim}), k_norm, k_norm ? eps : 0.0, std::nullopt,
                                   cos, sin);
  const torch::Tensor v = p[2].reshape({B, kv_heads, head_dim});
  const torch::Tensor attended = attention_decode(q.to(torch::kFloat32), k_cache, v_cache, positions, window, scale,
                                                  tables, table_lengths, block_size, k, v.contiguous());
  const torch::Tensor y = gemv(attended.reshape({B, heads * head_dim}).to(x.scalar_type()), {o}, {o_type},
                               heads * head_dim)[0];
  return add_residual(y, x, post_norm, eps);
}

torch::Tensor mlp_block(torch::Tensor x, torch::Tensor norm, double eps, torch::Tensor gate, int64_t gate_type,
                        torch::Tensor up, int64_t up_type, torch::Tensor down, int64_t down_type, int64_t act,
                        std::optional<torch::Tensor> post_norm) {
  TORCH_CHECK(x.dim() == 2, "mlp_block takes rows of hidden states: x [B, hidden]");
  const torch::Tensor h = rms_norm(x, norm, eps, std::nullopt, std::nullopt, std::nullopt);
  const std::vector<torch::Tensor> gu = gemv(h, {gate, up}, {gate_type, up_type}, x.size(1));
  const torch::Tensor a = gated_mul(gu[0], gu[1], act);
  const torch::Tensor y = gemv(a, {down}, {down_type}, a.size(1))[0];
  return add_residual(y, x, post_norm, eps);
}

}  // namespace strata_cpu
