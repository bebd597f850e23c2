// A decoder layer's RMS norm, rotary embedding and gated activation (mlx-lm's swiglu), each one
// node of MLX's graph on the CPU, for the models whose products go through the quantized kernel (quantized.cpp; all
// are bound in its module; attention.cpp holds the attention).
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
#include "mlx_math.h"
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

// silu(gate) * up as MLX computes it: sigmoid from exp(|g|) (Sigmoid), then g times it, then that times up.
inline float silu_times(float g, float u) {
  const float y = 1.0f / (1.0f + mlx_exp(std::fabs(g)));
  const float sigmoid = g < 0.0f ? y : 1.0f - y;
  return (g * sigmoid) * u;
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
  m.def("swiglu_rows", &swiglu_rows, nb::arg("gate"), nb::arg("up"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "mlx-lm's swiglu(gate, up), silu(gate) * up, as one node, for float32");
}
