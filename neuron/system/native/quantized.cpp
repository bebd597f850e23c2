// Products of a few rows against MLX's affine-quantized weights on the CPU: an MLX extension (a primitive of its
// own, in MLX's graph), built on the machine that runs it (neuron/system/native/__init__.py).
//
// Why: a decode step multiplies one row per sequence by every weight matrix once, so its time is the weights' bytes
// over the memory's bandwidth. MLX's CPU quantized_matmul reads 4-bit weights slower than fp32 BLAS reads fp32 ones
// (one thread, and a dequantize per element with no SIMD), which throws the quantization's gain away. This reads
// each packed word once, dequantizes it in registers (scale * q + bias, as MLX defines the layout), and multiplies
// it into every row, on every core of the rank.
//
// Layout (mlx.core.quantize): w is uint32 [N, K * bits / 32], element k of a row in bits [bits * (k % (32 / bits)),
// ...) of word k / (32 / bits); scales and biases are [N, K / group_size]; the result is x @ dequantize(w).T.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/scheduler.h"
#include "quantized.h"
#include "cpu_eval.h"
#include "strided.h"

namespace nb = nanobind;

namespace {

// The rows as float32, in the order the kernel reads them (``prepared_slot``; in order for packed weights).
std::vector<float> prepared(const mx::array& x, int rows, int k, int bits, bool packed) {
  // Read in place, strided or not (strided.h).
  const bool contiguous = x.flags().row_contiguous;
  const void* data = x.data<void>();
  std::vector<float> out(static_cast<size_t>(rows) * k);
  for (int m = 0; m < rows; m++) {
    float* row = out.data() + static_cast<size_t>(m) * k;
    for (int i = 0; i < k; i++) {
      const int at = packed ? i : prepared_slot(i, bits);
      const int64_t flat = static_cast<int64_t>(m) * k + i;
      row[at] = as_float(data, x.dtype(), contiguous ? flat : offset_of(x, flat));
    }
  }
  return out;
}

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int group_size, int bits, bool packed)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), packed_(packed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &x = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
    const int k = x.shape(-1), n = w.shape(0), rows = static_cast<int>(x.size() / k);
    queue_on_cpu(stream(), inputs, out,
                 [x, w, scales, biases, out, k, n, rows, group_size = group_size_, bits = bits_, packed = packed_]() mutable {
      std::vector<float> rows_prepared = prepared(x, rows, k, bits, packed);
      Problem p{rows_prepared.data(), w.data<uint32_t>(), scales.data<void>(), biases.data<void>(), scales.dtype(),
                out.data<void>(), out.dtype(), rows, n, k, group_size, bits, packed};
      multiply(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("quantized_rows runs on the CPU only");
  }

  const char* name() const override { return "QuantizedRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedRows&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && packed_ == o.packed_;
  }

 private:
  int group_size_, bits_;
  bool packed_;
};

mx::array quantized_rows(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                         int group_size, int bits, bool packed, mx::StreamOrDevice s) {
  if (packed && (!packs() || w.shape(0) % PACKED_COLUMNS != 0))
    throw std::invalid_argument("quantized_rows: packed weights are in blocks of 16 rows, on an AVX-512 build");
  if (bits != 4 && bits != 8) throw std::invalid_argument("quantized_rows takes 4- or 8-bit weights");
  if (group_size % 32 != 0) throw std::invalid_argument("quantized_rows takes groups of a multiple of 32");
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2)
    throw std::invalid_argument("quantized_rows: x [..., K], w, scales and biases 2-d");
  const int k = x.shape(-1), n = w.shape(0);
  if (w.dtype() != mx::uint32 || static_cast<int64_t>(w.shape(1)) * 32 != static_cast<int64_t>(k) * bits ||
      k % group_size != 0 || scales.shape(0) != n || scales.shape(1) != k / group_size ||
      biases.shape() != scales.shape())
    throw std::invalid_argument("quantized_rows: the weights' shapes do not match x's last dimension");
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16)
    throw std::invalid_argument("quantized_rows: x must be float32, float16 or bfloat16");
  if (scales.dtype() != biases.dtype() ||
      (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 && scales.dtype() != mx::bfloat16))
    throw std::invalid_argument("quantized_rows: scales and biases must be one float type");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = n;
  std::vector<mx::array> inputs;
  inputs.push_back(x);  // read strided as it is (``prepared``)
  for (const auto& a : {w, scales, biases})  // a model's weights are held contiguous already: no node to make them so
    inputs.push_back(a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream));
  return mx::array(std::move(shape), x.dtype(), std::make_shared<QuantizedRows>(stream, group_size, bits, packed),
                   std::move(inputs));
}

// w, scales and biases of 4- or 8-bit weights, packed in place for ``quantized_rows(..., packed=True)`` (``interleave``);
// false, and left as they are, where one is a view that is not row-contiguous (a slice of a matrix's columns). A
// graph still to be evaluated that reads them would read them packed: pack a model's weights as it is loaded.
bool pack(mx::array& w, mx::array& scales, mx::array& biases) {
  if (!packs()) throw std::invalid_argument("pack: this build of the kernel has no packed product (AVX-512)");
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || scales.ndim() != 2 || biases.shape() != scales.shape() ||
      scales.shape(0) != w.shape(0) || scales.dtype() != biases.dtype())
    throw std::invalid_argument("pack: w [N, K * bits / 32] uint32, scales and biases [N, K / group_size], one float type");
  if (w.shape(0) % PACKED_COLUMNS != 0) throw std::invalid_argument("pack: rows in blocks of 16");
  mx::eval({w, scales, biases});
  for (const auto* a : {&w, &scales, &biases})
    if (!a->flags().row_contiguous) return false;
  const int n = w.shape(0);
  interleave(w.data<void>(), n, w.shape(1), 4);
  interleave(scales.data<void>(), n, scales.shape(1), scales.itemsize());
  interleave(biases.data<void>(), n, biases.shape(1), biases.itemsize());
  return true;
}

// MLX's CPU evaluation holds its caller while more than ten tasks of ten dispatches each are queued on its streams
// (MAX_ACTIVE_TASKS in mlx/transforms.cpp), to bound the memory that operations queued ahead hold. A node takes two
// or three dispatches, and a small model's decode step is hundreds of nodes, so the stream ran dry while the caller
// built and read the step. The count is the scheduler's own, public in mlx/scheduler.h: lowering it by ``tasks``
// lets the caller queue that many more before it waits, and raising it by as many takes them back; the stream's own
// counting is unchanged between.
void queue_more(int tasks) {
  const auto stream = mx::default_stream(mx::Device::cpu);
  for (int i = 0; i < tasks; ++i) mx::scheduler::notify_task_completion(stream);
  for (int i = 0; i < -tasks; ++i) mx::scheduler::notify_new_task(stream);
}

}  // namespace

void bind_layers(nb::module_& m);     // layers.cpp
void bind_attention(nb::module_& m);  // attention.cpp

NB_MODULE(_quantized, m) {
  m.doc() = "x @ dequantize(w).T for a few rows of x, on the CPU, against MLX's affine 4- and 8-bit layouts";
  m.def("quantized_rows", &quantized_rows, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("packed") = false, nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "x @ dequantize(w, scales, biases).T (as mlx.core.quantized_matmul with transpose=True); packed: by pack()");
  m.def("pack", &pack, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        "pack 4- or 8-bit weights in place for quantized_rows(..., packed=True): each 16 rows' words interleaved; false where "
        "one is not row-contiguous (left as it is)");
  m.def("packs", []() { return packs(); }, "whether this build has the packed product (AVX-512)");
  m.def("threads", &threads, "the threads a shared product runs on, from the calling thread");
  m.def("set_cores", &set_cores, nb::arg("cores"), "run the products on these cores, a thread for each");
  m.def("blas", []() { return sgemm() != nullptr; }, "whether products of many rows go through cblas_sgemm");
  m.def("queue_more", &queue_more, nb::arg("tasks"),
        "let a caller of MLX's CPU evaluation queue this many tasks more before it waits; negative: take them back");
  bind_layers(m);
  bind_attention(m);
}
