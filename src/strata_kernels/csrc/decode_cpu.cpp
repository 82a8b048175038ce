// The small operations of a CPU decode step, each one call. At one token,
// torch's dispatch of the five to ten ops each is made of costs more than
// their arithmetic (an RMSNorm of 640 values took 25 us as torch ops).
//
//   rms_norm(x [..., D] float32|bfloat16, weight [D] float32, eps,
//            residual?, cos?, sin?) -> [..., D] in x's dtype
//       y = x / sqrt(mean(x^2) + eps) * weight                 (per row of D)
//       then, with cos/sin ([T, 1, D] float32, x [T, H, D]), the NEOX rotary
//       embedding of y at row t: y1*cos - y2*sin, y2*cos + y1*sin (halves);
//       then, with residual (x's shape and dtype), residual + y.
//       Computed in float32 and rounded to x's dtype once.
//
//   attention_decode(q [H, D] float32, k, v [capacity, Hkv, D] float32,
//                    runs [slot, count, slot, count, ...], scale) -> [H, D] float32
//       One query's softmax(q k^T * scale) v over the positions the runs
//       name (runs of ring slots, oldest first), grouped-query (query head h
//       reads KV head h / (H / Hkv)). The positions are split in chunks
//       across threads, each with its own max and sum, merged by
//       log-sum-exp: each K and V row is read once.

#include "cpu_kernels.h"
#include "lanes.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace strata_cpu {
namespace {

constexpr int64_t kAttentionChunk = 128;  // positions per task

template <class V>
void load_row(const V* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}

inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

inline float sum_of_squares(const float* x, int64_t n) {
  Lanes acc = Lanes::zero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes v = Lanes::load(x + i);
    acc = acc.fma(v, v);
  }
  float total = acc.sum();
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

template <class V>
void rms_norm_rows(const V* x, const float* weight, float eps, const V* residual, const float* cos, const float* sin,
                   int64_t heads, V* out, int64_t D, int64_t r0, int64_t r1) {
  std::vector<float> row(D), y(D);
  const int64_t half = D / 2;
  for (int64_t r = r0; r < r1; ++r) {
    load_row(x + r * D, row.data(), D);
    const float inv_rms = 1.0f / std::sqrt(sum_of_squares(row.data(), D) / float(D) + eps);
    for (int64_t i = 0; i < D; ++i) y[i] = row[i] * inv_rms * weight[i];
    if (cos != nullptr) {
      const float* c = cos + (r / heads) * D;
      const float* s = sin + (r / heads) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = y[i], b = y[i + half];
        y[i] = a * c[i] - b * s[i];
        y[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
    if (residual != nullptr) {
      load_row(residual + r * D, row.data(), D);
      for (int64_t i = 0; i < D; ++i) y[i] = row[i] + y[i];
    }
    store_row(y.data(), out + r * D, D);
  }
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, std::optional<torch::Tensor> residual,
                       std::optional<torch::Tensor> cos, std::optional<torch::Tensor> sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x must be contiguous");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 1 && weight.size(0) == D &&
                  weight.is_contiguous(),
              "weight must be float32 [", D, "]");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->is_contiguous(),
                "residual must be contiguous, with x's shape and dtype");
  }
  TORCH_CHECK(cos.has_value() == sin.has_value(), "give both cos and sin, or neither");
  int64_t heads = 1;
  if (cos) {
    TORCH_CHECK(x.dim() == 3 && D % 2 == 0, "rotary embedding needs x [T, H, D] with D even");
    for (const torch::Tensor& t : {*cos, *sin}) {
      TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == x.size(0) * D,
                  "cos and sin must be contiguous float32 [T, 1, D] for x [T, H, D]");
    }
    heads = x.size(1);
  }
  torch::Tensor out = torch::empty_like(x);
  const int64_t rows = x.numel() / std::max<int64_t>(D, 1);
  const float* c = cos ? cos->data_ptr<float>() : nullptr;
  const float* s = sin ? sin->data_ptr<float>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1));
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(torch::kFloat32, [&] {
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), float(eps),
                      residual ? residual->data_ptr<float>() : nullptr, c, s, heads, out.data_ptr<float>(), D, r0, r1);
      });
    })
    AT_DISPATCH_CASE(torch::kBFloat16, [&] {
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<float>(), float(eps),
                      residual ? residual->data_ptr<c10::BFloat16>() : nullptr, c, s, heads,
                      out.data_ptr<c10::BFloat16>(), D, r0, r1);
      });
    }));
  return out;
}

torch::Tensor attention_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<int64_t> runs,
                               double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 2 && q.is_contiguous(),
              "q must be contiguous float32 [H, D]");
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 && k.dim() == 3 &&
                  k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous(),
              "k and v must be contiguous float32 [capacity, Hkv, D]");
  const int64_t H = q.size(0), D = q.size(1), capacity = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0, "q [", H, ", ", D, "] does not fit K/V of ", Hkv, " heads of dim ",
              k.size(2));
  TORCH_CHECK(D % kLanes == 0, "head dim ", D, " is not a multiple of ", kLanes);
  TORCH_CHECK(runs.size() % 2 == 0 && !runs.empty(), "runs must be (slot, count) pairs");
  std::vector<int64_t> slots;
  for (size_t i = 0; i < runs.size(); i += 2) {
    TORCH_CHECK(runs[i] >= 0 && runs[i + 1] > 0 && runs[i] + runs[i + 1] <= capacity, "run (", runs[i], ", ",
                runs[i + 1], ") is outside ", capacity, " slots");
    for (int64_t j = 0; j < runs[i + 1]; ++j) slots.push_back(runs[i] + j);
  }
  const int64_t n = int64_t(slots.size()), G = H / Hkv;
  const int64_t chunks = (n + kAttentionChunk - 1) / kAttentionChunk;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  // Per chunk and query head: the chunk's max score, sum of exp(score - max),
  // and sum of exp(score - max) * v.
  std::vector<float> chunk_max(chunks * H), chunk_sum(chunks * H), chunk_acc(chunks * H * D, 0.0f);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> p(H * kAttentionChunk);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * kAttentionChunk, len = std::min(kAttentionChunk, n - j0);
      for (int64_t j = 0; j < len; ++j) {
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          const float* key = kp + (slots[j0 + j] * Hkv + hk) * D;
          for (int64_t h = hk * G; h < (hk + 1) * G; ++h) p[h * len + j] = dot(qp + h * D, key, D) * float(scale);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* ph = p.data() + h * len;
        const float m = *std::max_element(ph, ph + len);
        float total = 0.0f;
        for (int64_t j = 0; j < len; ++j) total += (ph[j] = std::exp(ph[j] - m));
        chunk_max[c * H + h] = m;
        chunk_sum[c * H + h] = total;
      }
      float* acc = chunk_acc.data() + c * H * D;
      for (int64_t j = 0; j < len; ++j) {
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          const float* value = vp + (slots[j0 + j] * Hkv + hk) * D;
          for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
            const float w = p[h * len + j];
            for (int64_t d = 0; d < D; d += kLanes)
              Lanes::load(acc + h * D + d).fma(Lanes::load(value + d), w).store(acc + h * D + d);
          }
        }
      }
    }
  });
  torch::Tensor out = torch::zeros({H, D}, q.options());
  float* o = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, chunk_max[c * H + h]);
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float w = std::exp(chunk_max[c * H + h] - m);
      total += w * chunk_sum[c * H + h];
      for (int64_t d = 0; d < D; ++d) o[h * D + d] += w * chunk_acc[(c * H + h) * D + d];
    }
    for (int64_t d = 0; d < D; ++d) o[h * D + d] /= total;
  }
  return out;
}

}  // namespace strata_cpu
