// A decoder layer's RMS norm, rotary embedding, gated activation (mlx-lm's swiglu) and attention's softmax, each one
// node of MLX's graph on the CPU, for the models whose products go through the quantized kernel (quantized.cpp; all
// are bound in its module).
//
// Why: on the CPU, mx.fast.rms_norm and mx.fast.rope have no kernel of their own; each call expands into the ops
// of its fallback (eleven nodes for a norm, about thirty for a rotation), and MLX dispatches every node with a
// cost of its own. A small model's decode step is then mostly dispatch. These compute what the fallbacks compute
// (mlx/fast.cpp), in the same order of operations, for float32 rows, as one node each.
//
// Compiled without contracting a * b + c into one rounding (CMakeLists.txt), as MLX's separate ops round each.
//
// The activation: mlx-lm's swiglu is an mx.compile'd silu(gate) * up, which MLX's CPU backend compiles with no
// instruction set beyond the baseline, so its exp runs one element at a time and calls the C library for each fma.
// Here the same arithmetic, operation for operation (MLX's simd::exp and Sigmoid, mlx/backend/cpu/simd/math.h and
// unary_ops.h), in a loop the compiler vectorizes for this machine: the same bits, many lanes at once.

#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "cpu_eval.h"
#include "strided.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// Row ``r`` of ``a`` (its last dimension) as a pointer and a stride, for a row whose elements may be strided.
struct Row {
  const float* start;
  int64_t step;
};

Row row_of(const mx::array& a, int64_t r) {
  const int64_t width = a.shape(-1);
  return {a.data<float>() + offset_of(a, r * width), static_cast<int64_t>(a.strides().back())};
}

class RMSNormRows : public mx::UnaryPrimitive {
 public:
  RMSNormRows(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &x = inputs[0], &w = inputs[1];
    queue_on_cpu(stream(), inputs, out, [x, w, out, eps = eps_]() mutable {
      const int64_t width = x.shape(-1), rows = static_cast<int64_t>(x.size()) / width;
      const Row weight = row_of(w, 0);
      float* y = out.data<float>();
      const float inverse_width = 1.0f / static_cast<float>(width);  // as MLX's mean: the sum times 1/n
      for (int64_t r = 0; r < rows; r++) {
        const Row in = row_of(x, r);
        float sum = 0.0f;
        for (int64_t i = 0; i < width; i++) {
          const float v = in.start[i * in.step];
          sum += v * v;
        }
        const float scale = 1.0f / std::sqrt(sum * inverse_width + eps);
        for (int64_t i = 0; i < width; i++) y[r * width + i] = (in.start[i * in.step] * scale) * weight.start[i * weight.step];
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("rms_norm_rows runs on the CPU only");
  }

  const char* name() const override { return "RMSNormRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNormRows&>(other).eps_;
  }

 private:
  float eps_;
};

class RotaryRows : public mx::UnaryPrimitive {
 public:
  RotaryRows(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &x = inputs[0], &offset = inputs[1];
    queue_on_cpu(stream(), inputs, out,
                 [x, offset, out, dims = dims_, traditional = traditional_, base = base_, scale = scale_]() mutable {
      // x is [B, ..., T, D]: positions run along its next-to-last dimension, from the batch row's offset.
      const int64_t width = x.shape(-1), positions = x.shape(-2), batch = x.shape(0);
      const int64_t rows = static_cast<int64_t>(x.size()) / width, per_batch = rows / batch;
      const int half = dims / 2;
      std::vector<float> inverse_frequency(half);
      const float step = std::log(base) / static_cast<float>(half);
      for (int i = 0; i < half; i++) inverse_frequency[i] = std::exp(static_cast<float>(-i) * step);
      // Each position's cosines and sines once, for every head that shares it: a prompt's rows would otherwise
      // take a sine and a cosine per head per pair.
      const int32_t* offsets = offset.data<int32_t>();
      const int64_t starts = offset.size();  // one offset for the batch, or one a batch row
      std::vector<float> cosines(starts * positions * half), sines(cosines.size());
      for (int64_t b = 0; b < starts; b++)
        for (int64_t t = 0; t < positions; t++) {
          const float position = (static_cast<float>(t) + static_cast<float>(offsets[b])) * scale;
          for (int i = 0; i < half; i++) {
            const float theta = position * inverse_frequency[i];
            cosines[(b * positions + t) * half + i] = std::cos(theta);
            sines[(b * positions + t) * half + i] = std::sin(theta);
          }
        }
      float* y = out.data<float>();
      for (int64_t r = 0; r < rows; r++) {
        const int64_t b = starts == 1 ? 0 : r / per_batch, t = r % positions;
        const float* c = cosines.data() + (b * positions + t) * half;
        const float* s = sines.data() + (b * positions + t) * half;
        const Row in = row_of(x, r);
        float* o = y + r * width;
        for (int i = 0; i < half; i++) {
          const int64_t first = traditional ? 2 * i : i, second = traditional ? 2 * i + 1 : i + half;
          const float x1 = in.start[first * in.step], x2 = in.start[second * in.step];
          o[first] = x1 * c[i] - x2 * s[i];
          o[second] = x1 * s[i] + x2 * c[i];
        }
        for (int64_t i = dims; i < width; i++) o[i] = in.start[i * in.step];
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("rotary_rows runs on the CPU only");
  }

  const char* name() const override { return "RotaryRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RotaryRows&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
};

// MLX's float exp (simd::exp), for each lane alike: a polynomial in the fraction of x / ln 2, times 2 to its whole
// part built in the exponent's bits. The whole part is floor(x + 0.5) taken in double, as MLX's (a float x plus the
// double 0.5): in float the sum could round up to the next whole number.
inline float mlx_exp(float x_init) {
  const float x = x_init * 1.442695f;
  const float ipart = static_cast<float>(std::floor(static_cast<double>(x) + 0.5));
  const float fpart = x - ipart;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, fpart, 1.339887440266574e-3f);
  p = std::fma(p, fpart, 9.618437357674640e-3f);
  p = std::fma(p, fpart, 5.550332471162809e-2f);
  p = std::fma(p, fpart, 2.402264791363012e-1f);
  p = std::fma(p, fpart, 6.931472028550421e-1f);
  p = std::fma(p, fpart, 1.000000000000000f);
  // Unsigned, so that a whole part out of range (replaced below) wraps instead of overflowing.
  const uint32_t bits = (static_cast<uint32_t>(static_cast<int32_t>(ipart)) + 127u) << 23;
  float two;
  std::memcpy(&two, &bits, sizeof two);
  float result = x_init != x_init ? x_init : two * p;
  result = x_init > 88.0f ? INFINITY : result;
  return x_init < -88.0f ? 0.0f : result;
}

// silu(gate) * up as MLX computes it: sigmoid from exp(|g|) (Sigmoid), then g times it, then that times up.
inline float silu_times(float g, float u) {
  const float y = 1.0f / (1.0f + mlx_exp(std::fabs(g)));
  const float sigmoid = g < 0.0f ? y : 1.0f - y;
  return (g * sigmoid) * u;
}

// The largest of a row's values as MLX's maximum finds it (a value that is no number wins, and stays), in lanes: the
// same value in any order, bar the sign of a zero, which no exp(x - max) can tell.
float row_maximum(const float* __restrict a, int64_t n) {
  constexpr int LANES = 16;
  float lane[LANES];
  int nan[LANES];
  for (int j = 0; j < LANES; j++) lane[j] = -INFINITY, nan[j] = 0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) {
      const float v = a[i + j];
      nan[j] |= v != v;
      lane[j] = v > lane[j] ? v : lane[j];
    }
  float out = -INFINITY;
  int any = 0;
  for (int j = 0; j < LANES; j++) out = lane[j] > out ? lane[j] : out, any |= nan[j];
  for (; i < n; i++) any |= a[i] != a[i], out = a[i] > out ? a[i] : out;
  return any ? NAN : out;
}

// mx.softmax(x, axis=-1) (precise or not: float32 either way) as MLX's CPU backend computes it one lane wide
// (mlx/backend/cpu/softmax.cpp): the row's maximum, each exp(x - max), their sum in order, then each times 1 / sum.
// The exps and products here take many lanes at once; the sum keeps MLX's order, so the bits are MLX's.
//
// Causal: x is a prompt's scores, [..., queries, keys] with the queries the last of the keys, and each query's
// row is what MLX's fallback makes of it with the causal mask (mlx/fast.cpp: the keys after the query replaced by
// float32's lowest, then the softmax). Those keys are not read: each would add exp(lowest - max), the same for the
// whole row (0, unless the row holds no number), to the maximum and the sum after the others, which is computed
// once. The same bits, without the mask's select and for half the exps.
class SoftmaxRows : public mx::UnaryPrimitive {
 public:
  SoftmaxRows(mx::Stream stream, bool causal) : mx::UnaryPrimitive(stream), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    queue_on_cpu(stream(), inputs, out, [x, out, causal = causal_]() mutable {
      const int64_t width = x.shape(-1), rows = static_cast<int64_t>(x.size()) / width;
      const int64_t queries = causal ? x.shape(-2) : 1;
      constexpr float lowest = -std::numeric_limits<float>::max();
      std::vector<float> gathered;
      for (int64_t r = 0; r < rows; r++) {
        // The keys this row sees: all, or up to its query's own position.
        const int64_t seen = causal ? std::clamp<int64_t>(r % queries + width - queries + 1, 0, width) : width;
        const Row in = row_of(x, r);
        const float* a = in.start;
        if (in.step != 1) {  // scores are a product's rows, adjacent: only an unusual caller's are not
          gathered.resize(width);
          for (int64_t i = 0; i < width; i++) gathered[i] = in.start[i * in.step];
          a = gathered.data();
        }
        float* __restrict o = out.data<float>() + r * width;
        float maximum = row_maximum(a, seen);
        if (seen < width && maximum == maximum) maximum = lowest > maximum ? lowest : maximum;
        for (int64_t i = 0; i < seen; i++) o[i] = mlx_exp(a[i] - maximum);
        const float hidden = mlx_exp(lowest - maximum);
        float sum = 0.0f;
        for (int64_t i = 0; i < seen; i++) sum += o[i];
        if (hidden != 0.0f)  // adding 0 to the sum would leave it as it is
          for (int64_t i = seen; i < width; i++) sum += hidden;
        const float inverse = 1 / sum;
        for (int64_t i = 0; i < seen; i++) o[i] *= inverse;
        const float beyond = hidden * inverse;
        for (int64_t i = seen; i < width; i++) o[i] = beyond;
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

class SwiGLURows : public mx::UnaryPrimitive {
 public:
  explicit SwiGLURows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &gate = inputs[0], &up = inputs[1];
    queue_on_cpu(stream(), inputs, out, [gate, up, out]() mutable {
      const int64_t width = gate.shape(-1), rows = static_cast<int64_t>(gate.size()) / width;
      float* y = out.data<float>();
      for (int64_t r = 0; r < rows; r++) {
        // A fused gate/up product's halves are views of one array: rows apart by its width, elements adjacent.
        const Row g = row_of(gate, r), u = row_of(up, r);
        float* o = y + r * width;
        if (g.step == 1 && u.step == 1) {
          const float* __restrict a = g.start;
          const float* __restrict b = u.start;
          for (int64_t i = 0; i < width; i++) o[i] = silu_times(a[i], b[i]);
        } else {
          for (int64_t i = 0; i < width; i++) o[i] = silu_times(g.start[i * g.step], u.start[i * u.step]);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("swiglu_rows runs on the CPU only");
  }

  const char* name() const override { return "SwiGLURows"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array swiglu_rows(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32)
    throw std::invalid_argument("swiglu_rows takes float32 gates and inputs");
  if (gate.ndim() < 1 || gate.shape() != up.shape())
    throw std::invalid_argument("swiglu_rows: the gate and the input must have one shape");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLURows>(stream), {gate, up});
}

mx::array rms_norm_rows(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32)
    throw std::invalid_argument("rms_norm_rows takes float32 rows and weights");
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm_rows: the weight must be as wide as x's last dimension");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNormRows>(stream, eps), {x, weight});
}

mx::array rotary_rows(const mx::array& x, const mx::array& offset, int dims, bool traditional, float base,
                      float scale, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("rotary_rows takes float32 rows");
  if (x.ndim() < 3) throw std::invalid_argument("rotary_rows: x must be [B, ..., T, D]");
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1))
    throw std::invalid_argument("rotary_rows: dims must be even, positive and at most x's last dimension");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 || (offset.size() != 1 && offset.size() != x.shape(0)))
    throw std::invalid_argument("rotary_rows: the offset must be one int32, or one for each of x's batch rows");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RotaryRows>(stream, dims, traditional, base, scale),
                   {x, offset});
}

}  // namespace

void bind_layers(nb::module_& m) {
  m.def("rms_norm_rows", &rms_norm_rows, nb::arg("x"), nb::arg("weight"), nb::arg("eps"), nb::kw_only(),
        nb::arg("stream") = nb::none(), "mlx.core.fast.rms_norm(x, weight, eps) as one node, for float32");
  m.def("rotary_rows", &rotary_rows, nb::arg("x"), nb::arg("offset"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("base"), nb::arg("scale"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "mlx.core.fast.rope(x, dims, traditional=, base=, scale=, offset=) as one node, for float32");
  m.def("softmax_rows", &softmax_rows, nb::arg("x"), nb::arg("causal") = false, nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "mlx.core.softmax(x, axis=-1) as MLX's CPU backend computes it, for float32, its exps vectorized; causal: "
        "with MLX's causal mask of scaled_dot_product_attention's fallback put in first");
  m.def("swiglu_rows", &swiglu_rows, nb::arg("gate"), nb::arg("up"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "mlx-lm's swiglu(gate, up), silu(gate) * up, as one node, for float32");
}
