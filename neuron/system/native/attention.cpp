// Attention for the models whose products go through the quantized kernel (quantized.cpp binds it): the softmax of
// MLX's fallback as one node, and a decode step's whole attention as one node.
//
// The softmax: mx.softmax as MLX's CPU backend computes it, its exps vectorized, MLX's bits (SoftmaxRows).
//
// A decode step's attention: on the CPU, mx.fast.scaled_dot_product_attention is MLX's fallback (mlx/fast.cpp), a
// dozen nodes a layer (scaling, head grouping, two products, the mask, the softmax). For one query row a head, its
// products are a row each, which MLX hands to the BLAS one head at a time. The nodes' dispatch and those calls cost
// more than the arithmetic, and a threaded BLAS's idle threads then spin beside the step (BENCHMARKS.md, "One node
// for a decode step's attention"). AttentionRows computes the same, for a few query rows, in one node: the scores
// of each key read once for every query row of its head group, the mask, the softmax above, and the weighted sum
// of the values. Its sums are taken in an order of its own, so its bits are not the BLAS's.
//
// Compiled without contracting a * b + c into one rounding (CMakeLists.txt), as MLX's separate ops round each.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <limits>
#include <optional>
#include <stdexcept>
#include <vector>

#include "cpu_eval.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx_math.h"
#include "strided.h"
#include "team.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr float LOWEST = -std::numeric_limits<float>::max();  // what MLX's fallback puts in a masked score
// Products of a step's attention (query rows x keys x width) from which its key heads are shared among the rank's
// cores: about 2,000 keys for a small model. Below, a helper's wake-up costs more than it saves.
constexpr int64_t SHARED_PRODUCTS = int64_t{1} << 20;

// One row's softmax as MLX's CPU backend computes it one lane wide (mlx/backend/cpu/softmax.cpp): the row's
// maximum, each exp(x - max), their sum in order, then each times 1 / sum. The exps and products take many lanes
// at once; the sum keeps MLX's order, so the bits are MLX's.
//
// Only the first ``seen`` of the row's ``width`` scores are read: the others stand for keys after a query under
// the causal mask (MLX's fallback sets them to float32's lowest, then takes the softmax). Each would add
// exp(lowest - max), the same for the whole row (0, unless the row holds no number), to the maximum and the sum
// after the others, which is computed once. The same bits, without the mask's select and for fewer exps.
void softmax_row(const float* __restrict a, float* __restrict o, int64_t width, int64_t seen) {
  float maximum = row_maximum(a, seen);
  if (seen < width && maximum == maximum) maximum = LOWEST > maximum ? LOWEST : maximum;
  for (int64_t i = 0; i < seen; i++) o[i] = mlx_exp(a[i] - maximum);
  const float hidden = mlx_exp(LOWEST - maximum);
  float sum = 0.0f;
  for (int64_t i = 0; i < seen; i++) sum += o[i];
  if (hidden != 0.0f)  // adding 0 to the sum would leave it as it is
    for (int64_t i = seen; i < width; i++) sum += hidden;
  const float inverse = 1 / sum;
  for (int64_t i = 0; i < seen; i++) o[i] *= inverse;
  const float beyond = hidden * inverse;
  for (int64_t i = seen; i < width; i++) o[i] = beyond;
}

// The keys a causal query row sees: up to its own position, the queries being the last of the keys.
inline int64_t seen_by(int64_t query, int64_t queries, int64_t keys) {
  return std::clamp<int64_t>(query + keys - queries + 1, 0, keys);
}

// mx.softmax(x, axis=-1) for float32 rows; causal: x is a prompt's scores, [..., queries, keys], with the causal
// mask of MLX's fallback in it (softmax_row).
class SoftmaxRows : public mx::UnaryPrimitive {
 public:
  SoftmaxRows(mx::Stream stream, bool causal) : mx::UnaryPrimitive(stream), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    queue_on_cpu(stream(), inputs, out, [x, out, causal = causal_]() mutable {
      const int64_t width = x.shape(-1), rows = static_cast<int64_t>(x.size()) / width;
      const int64_t queries = causal ? x.shape(-2) : 1;
      std::vector<float> gathered;
      for (int64_t r = 0; r < rows; r++) {
        const int64_t seen = causal ? seen_by(r % queries, queries, width) : width;
        const float* start = x.data<float>() + offset_of(x, r * width);
        const int64_t step = x.strides().back();
        const float* a = start;
        if (step != 1) {  // scores are a product's rows, adjacent: only an unusual caller's are not
          gathered.resize(width);
          for (int64_t i = 0; i < width; i++) gathered[i] = start[i * step];
          a = gathered.data();
        }
        softmax_row(a, out.data<float>() + r * width, width, seen);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("softmax_rows runs on the CPU only");
  }

  const char* name() const override { return "SoftmaxRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return causal_ == static_cast<const SoftmaxRows&>(other).causal_;
  }

 private:
  bool causal_;
};

mx::array softmax_rows(const mx::array& x, bool causal, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("softmax_rows takes float32 rows");
  if (x.ndim() < 1 || x.shape(-1) == 0) throw std::invalid_argument("softmax_rows: x needs rows of one value or more");
  if (causal && x.ndim() < 2) throw std::invalid_argument("softmax_rows: causal scores are [..., queries, keys]");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<SoftmaxRows>(stream, causal), {x});
}

// Sixteen partial sums, then their total: the compiler keeps the sixteen in one vector register (with std::fma it
// would not).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  constexpr int LANES = 16;
  float lane[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) lane[j] += a[i + j] * b[i + j];
  float sum = 0.0f;
  for (int j = 0; j < LANES; j++) sum += lane[j];
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

#if defined(__AVX512F__)
// With AVX-512, heads 64 or 128 wide (W vectors of 16) whose elements are adjacent: a block of 16 / W query rows at
// a time, in registers, and each key and value row read once for the block. A row's score is one vector's products
// summed as the instruction sums them, and the weighted sum is multiplied and added in one rounding: the same sums
// to float32's rounding, in another order.
template <int W>
inline void load_vectors(const float* at, __m512 (&out)[W]) {
  for (int w = 0; w < W; w++) out[w] = _mm512_loadu_ps(at + w * 16);
}

// Each block of query rows: its first row and how many it holds (16 / W, the last block fewer).
template <int W, class Block>
void in_blocks(int64_t rows, Block&& block) {
  constexpr int R = 16 / W;
  for (int64_t first = 0; first < rows; first += R) block(first, static_cast<int>(std::min<int64_t>(R, rows - first)));
}

template <int W>
void block_scores(const float* q, int64_t rows, const float* k, int64_t k_row, int64_t keys, float* scores) {
  in_blocks<W>(rows, [&](int64_t first, int n) {
    __m512 queries[16 / W][W];
    for (int r = 0; r < n; r++) load_vectors<W>(q + (first + r) * W * 16, queries[r]);
    for (int64_t s = 0; s < keys; s++) {
      __m512 key[W];
      load_vectors<W>(k + s * k_row, key);
      for (int r = 0; r < n; r++) {
        __m512 products = _mm512_mul_ps(queries[r][0], key[0]);
        for (int w = 1; w < W; w++) products = _mm512_fmadd_ps(queries[r][w], key[w], products);
        scores[(first + r) * keys + s] = _mm512_reduce_add_ps(products);
      }
    }
  });
}

template <int W>
void block_sums(const float* weights, int64_t rows, const float* v, int64_t v_row, int64_t keys, float* sums) {
  in_blocks<W>(rows, [&](int64_t first, int n) {
    __m512 sum[16 / W][W];
    for (auto& row : sum)
      for (auto& vector : row) vector = _mm512_setzero_ps();
    for (int64_t s = 0; s < keys; s++) {
      __m512 value[W];
      load_vectors<W>(v + s * v_row, value);
      for (int r = 0; r < n; r++) {
        const __m512 weight = _mm512_set1_ps(weights[(first + r) * keys + s]);
        for (int w = 0; w < W; w++) sum[r][w] = _mm512_fmadd_ps(weight, value[w], sum[r][w]);
      }
    }
    for (int r = 0; r < n; r++)
      for (int w = 0; w < W; w++) _mm512_storeu_ps(sums + (first + r) * W * 16 + w * 16, sum[r][w]);
  });
}
#endif

// The vectors of 16 a head's row holds where this build takes a decode step's query rows a block at a time
// (AVX-512, heads 64 or 128 wide whose keys' and values' elements are adjacent); else 0, for the loops below.
inline int block_vectors(int64_t width, int64_t k_step, int64_t v_step) {
#if defined(__AVX512F__)
  if (k_step == 1 && v_step == 1 && (width == 64 || width == 128)) return static_cast<int>(width / 16);
#endif
  return 0;
}

// block_scores and block_sums for ``vectors`` (block_vectors, not 0).
void scores_in_blocks(int vectors, const float* q, int64_t rows, const float* k, int64_t k_row, int64_t keys,
                      float* scores) {
#if defined(__AVX512F__)
  if (vectors == 4) block_scores<4>(q, rows, k, k_row, keys, scores);
  if (vectors == 8) block_scores<8>(q, rows, k, k_row, keys, scores);
#endif
}

void sums_in_blocks(int vectors, const float* weights, int64_t rows, const float* v, int64_t v_row, int64_t keys,
                    float* sums) {
#if defined(__AVX512F__)
  if (vectors == 4) block_sums<4>(weights, rows, v, v_row, keys, sums);
  if (vectors == 8) block_sums<8>(weights, rows, v, v_row, keys, sums);
#endif
}

// Element [i0, i1, i2, 0] of a 4-dimensional array, whatever its strides (a cache's keys are a view of its buffer,
// a mask is broadcast over heads).
inline const float* at4(const mx::array& a, int64_t i0, int64_t i1, int64_t i2) {
  const auto& st = a.strides();
  return a.data<float>() + i0 * st[0] + i1 * st[1] + i2 * st[2];
}

// q [B, H, L, D], keys and values [B, KV, S, D] (H a multiple of KV: each group of H / KV query heads reads one
// key head), and a mask, where there is one, [B, H, L, S]: true keeps a key (bool), or a number is added to the
// score (float32). The result is [B, H, L, D], as the fallback's.
class AttentionRows : public mx::UnaryPrimitive {
 public:
  AttentionRows(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
    const std::optional<mx::array> mask = inputs.size() > 3 ? std::optional(inputs[3]) : std::nullopt;
    queue_on_cpu(stream(), inputs, out, [q, k, v, mask, out, scale = scale_, causal = causal_]() mutable {
      const int64_t batch = q.shape(0), heads = q.shape(1), queries = q.shape(2), width = q.shape(3);
      const int64_t kv_heads = k.shape(1), keys = k.shape(2), repeats = heads / kv_heads;
      const int64_t rows = repeats * queries;  // one key head's query rows: its heads' in order, each its queries
      const int64_t q_step = q.strides()[3], k_step = k.strides()[3], v_step = v.strides()[3];
      float* y = out.data<float>();
      // Each key head of each batch row on its own, over the rank's cores where the context is long (team.h).
      const int64_t pairs = batch * kv_heads;
      const bool shared = pairs > 1 && pairs * rows * keys * width >= SHARED_PRODUCTS;
#pragma omp parallel for schedule(static) if (shared) num_threads(neuron::team())
      for (int64_t pair = 0; pair < pairs; pair++) {
        neuron::place_helper();
        const int64_t b = pair / kv_heads, g = pair % kv_heads;
        thread_local std::vector<float> scaled, scores, weights, sums, key, value;
        scaled.resize(rows * width), scores.resize(rows * keys), weights.resize(rows * keys);
        sums.resize(rows * width), key.resize(width), value.resize(width);
        for (int64_t r = 0; r < rows; r++) {  // scaled first, as the fallback scales the queries
          const float* in = at4(q, b, g * repeats + r / queries, r % queries);
          for (int64_t d = 0; d < width; d++) scaled[r * width + d] = scale * in[d * q_step];
        }
        const int vectors = block_vectors(width, k_step, v_step);
        const float *k0 = at4(k, b, g, 0), *v0 = at4(v, b, g, 0);
        const int64_t k_row = k.strides()[2], v_row = v.strides()[2];
        if (vectors) scores_in_blocks(vectors, scaled.data(), rows, k0, k_row, keys, scores.data());
        for (int64_t s = 0; s < keys && !vectors; s++) {
          const float* row = k0 + s * k_row;
          if (k_step != 1) {
            for (int64_t d = 0; d < width; d++) key[d] = row[d * k_step];
            row = key.data();
          }
          for (int64_t r = 0; r < rows; r++) scores[r * keys + s] = dot(scaled.data() + r * width, row, width);
        }
        for (int64_t r = 0; r < rows; r++) {
          float* score = scores.data() + r * keys;
          if (mask) {
            const mx::array& m = *mask;
            const int64_t m_step = m.strides()[3];
            const int64_t h = g * repeats + r / queries, l = r % queries;
            if (m.dtype() == mx::bool_) {
              const bool* keep = m.data<bool>() + b * m.strides()[0] + h * m.strides()[1] + l * m.strides()[2];
              for (int64_t s = 0; s < keys; s++) score[s] = keep[s * m_step] ? score[s] : LOWEST;
            } else {
              const float* add = at4(m, b, h, l);
              for (int64_t s = 0; s < keys; s++) score[s] = score[s] + add[s * m_step];
            }
          }
          softmax_row(score, weights.data() + r * keys, keys, causal ? seen_by(r % queries, queries, keys) : keys);
        }
        if (vectors) sums_in_blocks(vectors, weights.data(), rows, v0, v_row, keys, sums.data());
        if (!vectors) std::fill(sums.begin(), sums.end(), 0.0f);
        for (int64_t s = 0; s < keys && !vectors; s++) {
          const float* row = v0 + s * v_row;
          if (v_step != 1) {
            for (int64_t d = 0; d < width; d++) value[d] = row[d * v_step];
            row = value.data();
          }
          for (int64_t r = 0; r < rows; r++) {
            const float weight = weights[r * keys + s];
            float* __restrict sum = sums.data() + r * width;
            for (int64_t d = 0; d < width; d++) sum[d] += weight * row[d];
          }
        }
        for (int64_t r = 0; r < rows; r++) {
          const int64_t h = g * repeats + r / queries, l = r % queries;
          std::copy_n(sums.data() + r * width, width, y + ((b * heads + h) * queries + l) * width);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("attention_rows runs on the CPU only");
  }

  const char* name() const override { return "AttentionRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionRows&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

mx::array attention_rows(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                         const std::optional<mx::array>& mask, bool causal, mx::StreamOrDevice s) {
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32)
    throw std::invalid_argument("attention_rows takes float32 queries, keys and values");
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape())
    throw std::invalid_argument("attention_rows: queries are [B, H, L, D]; keys and values one shape, [B, KV, S, D]");
  if (k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument("attention_rows: keys need the queries' batch and width, and heads that divide theirs");
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) {
    if (causal) throw std::invalid_argument("attention_rows: a mask or causal, not both");
    if (mask->dtype() != mx::bool_ && mask->dtype() != mx::float32)
      throw std::invalid_argument("attention_rows: a mask is bool (keep) or float32 (added to the scores)");
    if (mask->shape() != mx::Shape{q.shape(0), q.shape(1), q.shape(2), k.shape(2)})
      throw std::invalid_argument("attention_rows: a mask is [B, H, L, S] (broadcast it there)");
    inputs.push_back(*mask);
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(q.shape(), mx::float32, std::make_shared<AttentionRows>(stream, scale, causal), std::move(inputs));
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("softmax_rows", &softmax_rows, nb::arg("x"), nb::arg("causal") = false, nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "mlx.core.softmax(x, axis=-1) as MLX's CPU backend computes it, for float32, its exps vectorized; causal: "
        "with MLX's causal mask of scaled_dot_product_attention's fallback put in first");
  m.def("attention_rows", &attention_rows, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("mask") = nb::none(), nb::arg("causal") = false, nb::kw_only(), nb::arg("stream") = nb::none(),
        "mlx.core.fast.scaled_dot_product_attention(q, k, v, scale=, mask=) for a few float32 query rows, as one "
        "node; mask: None, or [B, H, L, S], bool or float32; causal: the fallback's causal mask");
}
