// The recurrent layers' decode step (Gated DeltaNet), one token per sequence,
// each sequence's state in its slot of a layer's store.
//
//   delta_rule_step(q, k [B, Hk, Dk] float32, v [B, Hv, Dv] float32,
//                   g, beta [B, Hv] float32, state [S, Hv, Dk, Dv] float32,
//                   slots [B] int64) -> [B, Hv, Dv] float32
//       For sequence b and value head h (key head h / (Hv / Hk)), with
//       M = state[slots[b], h] ([Dk, Dv]):
//         M = exp(g) M;  u = beta (v - M^T k);  M = M + k u^T;  o = M^T q
//       in place: M is read twice (the second time from cache: 64 KiB at
//       Dk = Dv = 128) and written once. Tasks (sequence, head) are shared
//       among the threads.
//
//   conv_step(x [B, C] float32, weight [C, K] float32, conv [S, K-1, C] float32,
//             slots [B] int64) -> [B, C] float32
//       The causal depthwise convolution's next output per sequence:
//       sum_j window[j] * weight[:, j] + x * weight[:, K-1], window = conv[slots[b]]
//       (oldest input first); the window then shifts by one, x entering last.
//
// The inner loops run along Dv (or C), one independent lane per element, so
// the compiler vectorizes them without reassociating any sum.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace strata_cpu {

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous float32 CPU tensor");
}

}  // namespace

torch::Tensor delta_rule_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                              torch::Tensor state, torch::Tensor slots) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  check_f32(g, "g");
  check_f32(beta, "beta");
  check_f32(state, "state");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "slots must be contiguous int64");
  const int64_t B = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == B && Hv % Hk == 0 && g.size(0) == B && g.size(1) == Hv &&
                  beta.sizes() == g.sizes() && slots.size(0) == B && state.dim() == 4 && state.size(1) == Hv &&
                  state.size(2) == Dk && state.size(3) == Dv,
              "delta_rule_step: shapes disagree");
  const int64_t S = state.size(0), group = Hv / Hk;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(slot[b] >= 0 && slot[b] < S, "slot ", slot[b], " is not in the store");
  auto out = torch::empty({B, Hv, Dv}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B * Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u(Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hv, h = task % Hv;
      float* m = sp + (slot[b] * Hv + h) * Dk * Dv;
      const float* kk = kp + (b * Hk + h / group) * Dk;
      const float* qq = qp + (b * Hk + h / group) * Dk;
      const float* vv = vp + (b * Hv + h) * Dv;
      float* o = op + (b * Hv + h) * Dv;
      const float decay = std::exp(gp[b * Hv + h]), rate = bp[b * Hv + h];
      // u = M^T k (before the decay), then the correction the rule writes.
      for (int64_t j = 0; j < Dv; ++j) u[j] = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        const float* row = m + i * Dv;
        const float ki = kk[i];
        for (int64_t j = 0; j < Dv; ++j) u[j] += row[j] * ki;
      }
      for (int64_t j = 0; j < Dv; ++j) u[j] = rate * (vv[j] - decay * u[j]);
      // M = decay M + k u^T, and o = M^T q from the new rows.
      for (int64_t j = 0; j < Dv; ++j) o[j] = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = m + i * Dv;
        const float ki = kk[i], qi = qq[i];
        for (int64_t j = 0; j < Dv; ++j) {
          const float next = row[j] * decay + ki * u[j];
          row[j] = next;
          o[j] += next * qi;
        }
      }
    }
  });
  return out;
}

torch::Tensor conv_step(torch::Tensor x, torch::Tensor weight, torch::Tensor conv, torch::Tensor slots) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  check_f32(conv, "conv");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "slots must be contiguous int64");
  const int64_t B = x.size(0), C = x.size(1), K = weight.size(1), W = K - 1;
  TORCH_CHECK(weight.size(0) == C && conv.dim() == 3 && conv.size(1) == W && conv.size(2) == C &&
                  slots.size(0) == B,
              "conv_step: shapes disagree");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < conv.size(0), "slot ", slot[b], " is not in the store");
  // The weight's taps as rows [K, C], so every loop runs along the channels.
  const auto taps = weight.t().contiguous();
  auto out = torch::empty({B, C}, x.options());
  const float *xp = x.data_ptr<float>(), *tp = taps.data_ptr<float>();
  float *cp = conv.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* window = cp + slot[b] * W * C;
      const float* xb = xp + b * C;
      float* o = op + b * C;
      for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
      for (int64_t j = 0; j < W; ++j)
        for (int64_t c = 0; c < C; ++c) o[c] += window[j * C + c] * tp[j * C + c];
      for (int64_t c = 0; c < C; ++c) o[c] += xb[c] * tp[W * C + c];
      for (int64_t j = 0; j + 1 < W; ++j)
        for (int64_t c = 0; c < C; ++c) window[j * C + c] = window[(j + 1) * C + c];
      if (W > 0)
        for (int64_t c = 0; c < C; ++c) window[(W - 1) * C + c] = xb[c];
    }
  });
  return out;
}

}  // namespace strata_cpu
