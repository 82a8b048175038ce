// The small operations of a CPU decode step, each one call. At one token,
// torch's dispatch of the five to ten ops each is made of costs more than
// their arithmetic (an RMSNorm of 640 values took 25 us as torch ops).
//
//   rms_norm(x [..., D] float32|bfloat16, weight? [D] float32, eps,
//            residual?, cos?, sin?) -> [..., D] in x's dtype
//       y = x / sqrt(mean(x^2) + eps) * weight                 (per row of D;
//       without a weight, y = x: the rotation alone, Llama's queries and keys)
//       then, with cos/sin ([T, 1, D] float32, x [T, H, D]), the NEOX rotary
//       embedding of y at row t: y1*cos - y2*sin, y2*cos + y1*sin (halves);
//       then, with residual (x's shape and dtype), residual + y.
//       Computed in float32 and rounded to x's dtype once.
//
//   gated_mul(gate, up [...] float32|bfloat16, one dtype, act) -> gate's shape and dtype
//       act(gate) * up, the gated MLP's middle (act 0: gelu_tanh, Gemma;
//       1: silu, Llama and Qwen), in float32 and rounded once.
//
//   attention_decode(q [B, H, D] float32, k, v [slots, Hkv, D] float32|bfloat16,
//                    positions [B] int64, window?, scale, tables [B, NB] int32,
//                    table_lengths [B] int32, block_size, new_k?, new_v?) -> [B, H, D] float32
//       One query per sequence b at positions[b], its keys and values in
//       blocks of block_size slots: position p lives in slot
//       tables[b][(p / block_size) % table_lengths[b]] * block_size + p % block_size
//       (a ring of table_lengths[b] blocks; a contiguous ring is one block of
//       its capacity). First (if given) each query's own key and value
//       ([B, Hkv, D]) are written into its slot; then softmax(q k^T * scale) v
//       over positions max(0, position - window + 1)..position, grouped-query
//       (query head h reads KV head h / (H / Hkv)). Every sequence's positions
//       are split in chunks, all sequences' chunks shared among the threads,
//       each with its own max and sum, merged by log-sum-exp: each K and V row
//       is read once.

#include "cpu_kernels.h"
#include "lanes.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace strata_cpu {
namespace {

constexpr int64_t kAttentionChunk = 128;  // positions per task (a multiple of kLanes)
constexpr int64_t kPrefetchAhead = 16;     // positions

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
    if (weight != nullptr) {
      const float inv_rms = 1.0f / std::sqrt(sum_of_squares(row.data(), D) / float(D) + eps);
      for (int64_t i = 0; i < D; ++i) y[i] = row[i] * inv_rms * weight[i];
    } else {
      std::copy(row.begin(), row.end(), y.begin());
    }
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

torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> weight, double eps,
                       std::optional<torch::Tensor> residual, std::optional<torch::Tensor> cos,
                       std::optional<torch::Tensor> sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x must be contiguous");
  const int64_t D = x.size(-1);
  if (weight) {
    TORCH_CHECK(weight->scalar_type() == torch::kFloat32 && weight->dim() == 1 && weight->size(0) == D &&
                    weight->is_contiguous(),
                "weight must be float32 [", D, "]");
  }
  const float* w = weight ? weight->data_ptr<float>() : nullptr;
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
        rms_norm_rows(x.data_ptr<float>(), w, float(eps),
                      residual ? residual->data_ptr<float>() : nullptr, c, s, heads, out.data_ptr<float>(), D, r0, r1);
      });
    })
    AT_DISPATCH_CASE(torch::kBFloat16, [&] {
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        rms_norm_rows(x.data_ptr<c10::BFloat16>(), w, float(eps),
                      residual ? residual->data_ptr<c10::BFloat16>() : nullptr, c, s, heads,
                      out.data_ptr<c10::BFloat16>(), D, r0, r1);
      });
    }));
  return out;
}

namespace {

// dst (a contiguous row of the ring) = src, rounded to dst's dtype: plain
// loops for the float32/bfloat16 rows a decode step writes (torch's copy_
// costs more than the attention it feeds at short contexts), copy_ otherwise.
void write_row(const torch::Tensor& src, torch::Tensor dst) {
  const int64_t n = dst.numel();
  if (src.is_contiguous() && src.scalar_type() == torch::kFloat32) {
    if (dst.scalar_type() == torch::kBFloat16)
      return store_row(src.data_ptr<float>(), dst.data_ptr<c10::BFloat16>(), n);
    if (dst.scalar_type() == torch::kFloat32) return store_row(src.data_ptr<float>(), dst.data_ptr<float>(), n);
  }
  dst.copy_(src.reshape(dst.sizes()));
}

constexpr int kMaxGroup = 8;  // query heads per KV head handled together
// Lanes of the head dim per pass over V for G heads: as many as keep the G x
// tiles accumulators in registers (about 24 zmm of AVX-512's 32, 12 ymm of
// AVX2's 16; beyond that every multiply-add spilled to the stack: AVX2 decode
// attention ran 4x slower with 4 tiles for 3 heads).
template <int G>
constexpr int kTiles = std::max(1, std::min(4, (kRegistersPerLanes == 1 ? 24 : 12) / (G * kRegistersPerLanes)));

// sum_j e[g][j] * v_j over a chunk's rows for dims d0..d0+TILES*kLanes-1,
// the G x TILES accumulators in registers while the rows stream past.
template <int G, int TILES, class KV>
void weighted_values(const KV* v, const int64_t* slots, int64_t len, int64_t Hkv, int64_t hk, int64_t D, int64_t d0,
                     const float* e, float* acc_out) {
  Lanes acc[G][TILES];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TILES; ++t) acc[g][t] = Lanes::zero();
  for (int64_t j = 0; j < len; ++j) {
    const KV* value = v + (slots[j] * Hkv + hk) * D + d0;
    for (int t = 0; t < TILES; ++t) {
      const Lanes vv = Lanes::load(value + t * kLanes);
      for (int g = 0; g < G; ++g) acc[g][t] = acc[g][t].fma(vv, e[g * kAttentionChunk + j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TILES; ++t) acc[g][t].store(acc_out + g * D + d0 + t * kLanes);
}

// One chunk of positions (their ring slots) for the G query heads h0.. of KV
// head hk: per head, the chunk's max score m, sum of e = exp(score - m), and
// acc = sum_j e_j * v_j ([G, D]). p is scratch of G rows of kAttentionChunk.
// G is a template argument so that the per-head accumulators live in
// registers (with a run-time G they went through the stack: 4x slower).
template <int G, class KV>
void attend_chunk(const float* q, const KV* k, const KV* v, const int64_t* slots, int64_t len, int64_t slots_left,
                  int64_t Hkv, int64_t hk, int64_t h0, int64_t D, float scale, int64_t prefetch_bytes, float* p,
                  float* max_out, float* sum_out, float* acc_out) {
  // Scores: each key row is loaded once for the G query heads. The first
  // pass over a chunk prefetches the K and V rows (prefetch_bytes of each,
  // from head hk's row on) a few positions ahead, on into the next chunk
  // (slots_left positions remain from this chunk's first), so that the value
  // pass and the chunk's other heads find them in cache; from memory, the
  // hardware prefetcher alone left this at a third of the read bandwidth.
  for (int64_t j = 0; j < len; ++j) {
    if (prefetch_bytes && j + kPrefetchAhead < slots_left) {
      const int64_t ahead = (slots[j + kPrefetchAhead] * Hkv + hk) * D;
      for (int64_t off = 0; off < prefetch_bytes; off += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k + ahead) + off);
        __builtin_prefetch(reinterpret_cast<const char*>(v + ahead) + off);
      }
    }
    const KV* key = k + (slots[j] * Hkv + hk) * D;
    Lanes dot[G];
    for (int g = 0; g < G; ++g) dot[g] = Lanes::zero();
    for (int64_t d = 0; d < D; d += kLanes) {
      const Lanes kv = Lanes::load(key + d);
      for (int g = 0; g < G; ++g) dot[g] = dot[g].fma(Lanes::load(q + (h0 + g) * D + d), kv);
    }
    for (int g = 0; g < G; ++g) p[g * kAttentionChunk + j] = dot[g].sum() * scale;
  }
  // e = exp(score - m), whole lanes at a time: the padding past len is
  // -inf, whose e is 0.
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  for (int g = 0; g < G; ++g) {
    float* pg = p + g * kAttentionChunk;
    const float m = *std::max_element(pg, pg + len);
    std::fill(pg + len, pg + padded, -std::numeric_limits<float>::infinity());
    const Lanes minus_m = Lanes::fill(-m);
    Lanes total = Lanes::zero();
    for (int64_t j = 0; j < padded; j += kLanes) {
      const Lanes e = Lanes::load(pg + j).add(minus_m).exp();
      e.store(pg + j);
      total = total.add(e);
    }
    max_out[g] = m;
    sum_out[g] = total.sum();
  }
  int64_t d0 = 0;
  for (; d0 + kTiles<G> * kLanes <= D; d0 += kTiles<G> * kLanes)
    weighted_values<G, kTiles<G>>(v, slots, len, Hkv, hk, D, d0, p, acc_out);
  for (; d0 < D; d0 += kLanes) weighted_values<G, 1>(v, slots, len, Hkv, hk, D, d0, p, acc_out);
}

template <class KV>
void attend_chunk_any(int G, const float* q, const KV* k, const KV* v, const int64_t* slots, int64_t len,
                      int64_t slots_left, int64_t Hkv, int64_t hk, int64_t h0, int64_t D, float scale,
                      int64_t prefetch_bytes, float* p, float* max_out, float* sum_out, float* acc_out) {
  switch (G) {
#define STRATA_GROUP(n)                                                                                      \
  case n:                                                                                                    \
    return attend_chunk<n>(q, k, v, slots, len, slots_left, Hkv, hk, h0, D, scale, prefetch_bytes, p, max_out, \
                           sum_out, acc_out);
    STRATA_GROUP(1) STRATA_GROUP(2) STRATA_GROUP(3) STRATA_GROUP(4)
    STRATA_GROUP(5) STRATA_GROUP(6) STRATA_GROUP(7) STRATA_GROUP(8)
#undef STRATA_GROUP
  }
}

}  // namespace

torch::Tensor attention_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                               std::optional<int64_t> window, double scale, torch::Tensor tables,
                               torch::Tensor table_lengths, int64_t block_size, std::optional<torch::Tensor> new_k,
                               std::optional<torch::Tensor> new_v) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 3 && q.is_contiguous(),
              "q must be contiguous float32 [B, H, D]");
  TORCH_CHECK((k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16) &&
                  v.scalar_type() == k.scalar_type() && k.dim() == 3 && k.sizes() == v.sizes() &&
                  k.is_contiguous() && v.is_contiguous(),
              "k and v must be contiguous float32 or bfloat16 [slots, Hkv, D], of one dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), n_slots = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0, "q [B, ", H, ", ", D, "] does not fit K/V of ", Hkv,
              " heads of dim ", k.size(2));
  TORCH_CHECK(D % kLanes == 0, "head dim ", D, " is not a multiple of ", kLanes);
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == B && positions.is_contiguous(),
              "positions must be contiguous int64 [B]");
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && tables.dim() == 2 && tables.size(0) == B &&
                  tables.is_contiguous() && table_lengths.scalar_type() == torch::kInt32 &&
                  table_lengths.numel() == B && table_lengths.is_contiguous(),
              "tables must be contiguous int32 [B, NB] and table_lengths int32 [B]");
  TORCH_CHECK(block_size > 0 && n_slots % block_size == 0, "block_size ", block_size, " does not divide the ",
              n_slots, " slots");
  TORCH_CHECK(new_k.has_value() == new_v.has_value(), "give both new_k and new_v, or neither");
  if (new_k) {
    for (const torch::Tensor& t : {*new_k, *new_v})
      TORCH_CHECK(t.numel() == B * Hkv * D, "new_k and new_v must hold ", B, " x ", Hkv, " x ", D, " values");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* ring = table_lengths.data_ptr<int32_t>();
  const int64_t NB = tables.size(1), blocks_held = n_slots / block_size;
  // Every sequence's slots in position order, one list after another.
  std::vector<int64_t> slots, seq_first(B + 1, 0), chunk_first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t position = pos[b], blocks = ring[b];
    TORCH_CHECK(blocks >= 1 && blocks <= NB, "sequence ", b, ": table length ", blocks, " is not in 1..", NB);
    const int64_t first = window ? std::max<int64_t>(0, position - *window + 1) : 0;
    TORCH_CHECK(position >= 0 && position - first < blocks * block_size, "sequence ", b, ": position ", position,
                " sees ", position - first + 1, " positions, more than its ", blocks * block_size, " slots hold");
    for (int64_t p = first; p <= position; ++p) {
      const int64_t block = tab[b * NB + (p / block_size) % blocks];
      TORCH_CHECK(block >= 0 && block < blocks_held, "sequence ", b, ": block ", block, " is not in 0..",
                  blocks_held - 1);
      slots.push_back(block * block_size + p % block_size);
    }
    seq_first[b + 1] = int64_t(slots.size());
    const int64_t n = seq_first[b + 1] - seq_first[b];
    chunk_first[b + 1] = chunk_first[b] + (n + kAttentionChunk - 1) / kAttentionChunk;
    if (new_k) {  // the query's own key and value first, into its slot (the list's last)
      write_row(new_k->reshape({B, Hkv * D})[b], k.select(0, slots.back()));
      write_row(new_v->reshape({B, Hkv * D})[b], v.select(0, slots.back()));
    }
  }
  const int64_t G = H / Hkv, chunks = chunk_first[B];
  // Tasks: (chunk of some sequence, KV heads, group of up to kMaxGroup query
  // heads per KV head). A task takes every KV head of its chunk, reading
  // whole position rows (contiguous memory for the prefetchers; SmolLM2's
  // 2,000 positions read from memory: 154 -> 133 us a layer, within this
  // VM's noise of the runs after), unless that leaves too few tasks for the threads.
  const int64_t parts = (G + kMaxGroup - 1) / kMaxGroup;
  const int64_t heads_per_task = chunks >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t tasks = chunks * (Hkv / heads_per_task) * parts;
  const int64_t row_bytes = D * int64_t(k.element_size());
  // Per chunk and query head: max score, sum of exp(score - max), and
  // sum of exp(score - max) * v.
  std::vector<float> chunk_max(chunks * H), chunk_sum(chunks * H), chunk_acc(chunks * H * D);
  const float* qp = q.data_ptr<float>();
  const float s = float(scale);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(kMaxGroup * kAttentionChunk);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t part = task % parts, first_head = (task / parts) % (Hkv / heads_per_task) * heads_per_task;
      const int64_t c = task / (parts * (Hkv / heads_per_task));
      const int64_t b = std::upper_bound(chunk_first.begin(), chunk_first.end(), c) - chunk_first.begin() - 1;
      const int64_t n = seq_first[b + 1] - seq_first[b];
      const int64_t j0 = (c - chunk_first[b]) * kAttentionChunk, len = std::min(kAttentionChunk, n - j0);
      const int64_t* seq_slots = slots.data() + seq_first[b] + j0;
      const int group = int(std::min<int64_t>(kMaxGroup, G - part * kMaxGroup));
      for (int64_t hk = first_head; hk < first_head + heads_per_task; ++hk) {
        const int64_t h0 = hk * G + part * kMaxGroup;
        // The first head's pass prefetches the rows of every head this task reads.
        const int64_t prefetch = hk == first_head ? heads_per_task * row_bytes : 0;
        float* mx = chunk_max.data() + c * H + h0;
        float* sm = chunk_sum.data() + c * H + h0;
        float* acc = chunk_acc.data() + (c * H + h0) * D;
        const float* qb = qp + b * H * D;
        if (k.scalar_type() == torch::kFloat32) {
          attend_chunk_any(group, qb, k.data_ptr<float>(), v.data_ptr<float>(), seq_slots, len, n - j0, Hkv, hk,
                           h0, D, s, prefetch, p.data(), mx, sm, acc);
        } else {
          attend_chunk_any(group, qb, k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), seq_slots, len,
                           n - j0, Hkv, hk, h0, D, s, prefetch, p.data(), mx, sm, acc);
        }
      }
    }
  });
  // Merge each sequence's chunks by log-sum-exp.
  torch::Tensor out = torch::zeros({B, H, D}, q.options());
  for (int64_t b = 0; b < B; ++b) {
    float* o = out.data_ptr<float>() + b * H * D;
    for (int64_t h = 0; h < H; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = chunk_first[b]; c < chunk_first[b + 1]; ++c) m = std::max(m, chunk_max[c * H + h]);
      float total = 0.0f;
      for (int64_t c = chunk_first[b]; c < chunk_first[b + 1]; ++c) {
        const float w = std::exp(chunk_max[c * H + h] - m);
        total += w * chunk_sum[c * H + h];
        for (int64_t d = 0; d < D; ++d) o[h * D + d] += w * chunk_acc[(c * H + h) * D + d];
      }
      for (int64_t d = 0; d < D; ++d) o[h * D + d] /= total;
    }
  }
  return out;
}

namespace {

// gelu_tanh(g) * u = g * (1 - 1 / (e + 1)) * u with e = exp(2 sqrt(2/pi) (g + 0.044715 g^3)):
// 0.5 g (1 + tanh(y)) with tanh(y) = 1 - 2 / (exp(2y) + 1), which stays finite
// at both ends (e = inf gives g, e = 0 gives 0).
// silu(g) * u = g * (1 - 1 / (e + 1)) * u with e = exp(g): g / (1 + exp(-g))
// written the same finite way. Both activations are g * sigmoid(a g + b g^3).
template <class V>
void gated_mul_range(const V* gate, const V* up, V* out, int64_t i0, int64_t i1, bool silu) {
  constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;
  alignas(64) float g[kLanes], e[kLanes], y[kLanes];
  for (int64_t i = i0; i < i1; i += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, i1 - i);
    for (int64_t j = 0; j < n; ++j) {
      g[j] = float(gate[i + j]);
      e[j] = silu ? g[j] : kTwoSqrt2OverPi * (g[j] + 0.044715f * g[j] * g[j] * g[j]);
    }
    if (n == kLanes) {
      Lanes::load(e).exp().store(e);
    } else {
      for (int64_t j = 0; j < n; ++j) e[j] = std::exp(e[j]);
    }
    for (int64_t j = 0; j < n; ++j) y[j] = g[j] * (1.0f - 1.0f / (e[j] + 1.0f)) * float(up[i + j]);
    store_row(y, out + i, n);
  }
}

}  // namespace

torch::Tensor gated_mul(torch::Tensor gate, torch::Tensor up, int64_t act) {
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (gelu_tanh) or 1 (silu), got ", act);
  const bool silu = act == 1;
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == torch::kFloat32 || gate.scalar_type() == torch::kBFloat16),
              "gate and up must be float32 or bfloat16 tensors of one shape and dtype");
  gate = gate.contiguous();
  up = up.contiguous();
  torch::Tensor out = torch::empty_like(gate);
  const int64_t n = gate.numel();
  // Whole lanes per task, so that only the last one has a tail.
  const int64_t grain = 16384;
  if (gate.scalar_type() == torch::kFloat32) {
    at::parallel_for(0, (n + kLanes - 1) / kLanes, grain / kLanes, [&](int64_t b0, int64_t b1) {
      gated_mul_range(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>(), b0 * kLanes,
                      std::min(n, b1 * kLanes), silu);
    });
  } else {
    at::parallel_for(0, (n + kLanes - 1) / kLanes, grain / kLanes, [&](int64_t b0, int64_t b1) {
      gated_mul_range(gate.data_ptr<c10::BFloat16>(), up.data_ptr<c10::BFloat16>(),
                      out.data_ptr<c10::BFloat16>(), b0 * kLanes, std::min(n, b1 * kLanes), silu);
    });
  }
  return out;
}

}  // namespace strata_cpu
