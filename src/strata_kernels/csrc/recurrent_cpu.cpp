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
//   delta_rule_scan(q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv])
//       -> [T, Hv, Dv] float32
//       One sequence's T tokens in order (a prompt), the same arithmetic as
//       delta_rule_step token by token; heads are shared among the threads
//       and each keeps its [Dk, Dv] state in cache for all T tokens, so the
//       state leaves memory once. On a CPU this beats the chunked form (whose
//       matrix products do more arithmetic: chunks buy parallelism, which a
//       GPU needs and two cores do not).
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

// One token of one value head: M = exp(g) M; u = beta (v - M^T k); M += k u^T; o = M^T q.
inline void delta_step_head(float* m, const float* kk, const float* qq, const float* vv, float g, float rate,
                            float* o, float* u, int64_t Dk, int64_t Dv) {
  const float decay = std::exp(g);
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

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
                  const torch::Tensor& beta) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  check_f32(g, "g");
  check_f32(beta, "beta");
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == q.size(0) && v.size(1) % q.size(1) == 0 &&
                  g.size(0) == q.size(0) && g.size(1) == v.size(1) && beta.sizes() == g.sizes(),
              "the delta rule's q, k, v, g and beta disagree in shape");
}

}  // namespace

torch::Tensor delta_rule_scan(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                              torch::Tensor state) {
  check_inputs(q, k, v, g, beta);
  check_f32(state, "state");
  const int64_t T = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  TORCH_CHECK(state.dim() == 3 && state.size(0) == Hv && state.size(1) == Dk && state.size(2) == Dv,
              "delta_rule_scan: the state must be [Hv, Dk, Dv]");
  const int64_t group = Hv / Hk;
  auto out = torch::empty({T, Hv, Dv}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u(Dv);
    for (int64_t h = begin; h < end; ++h) {
      float* m = sp + h * Dk * Dv;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t kq = (t * Hk + h / group) * Dk, at = t * Hv + h;
        delta_step_head(m, kp + kq, qp + kq, vp + at * Dv, gp[at], bp[at], op + at * Dv, u.data(), Dk, Dv);
      }
    }
  });
  return out;
}

torch::Tensor delta_rule_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                              torch::Tensor state, torch::Tensor slots) {
  check_inputs(q, k, v, g, beta);
  check_f32(state, "state");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "slots must be contiguous int64");
  const int64_t B = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  TORCH_CHECK(slots.size(0) == B && state.dim() == 4 && state.size(1) == Hv && state.size(2) == Dk &&
                  state.size(3) == Dv,
              "delta_rule_step: the state must be [slots, Hv, Dk, Dv] and slots [B]");
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
      const int64_t b = task / Hv, h = task % Hv, kq = (b * Hk + h / group) * Dk, at = b * Hv + h;
      delta_step_head(sp + (slot[b] * Hv + h) * Dk * Dv, kp + kq, qp + kq, vp + at * Dv, gp[at], bp[at],
                      op + at * Dv, u.data(), Dk, Dv);
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
