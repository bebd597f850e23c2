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

#include <omp.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int MAX_ROWS = 8;  // rows multiplied per pass over the weights; more take further passes
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048  // how far ahead of its reads a helper asks for the weights it reads next
#endif

float as_float(const void* p, mx::Dtype dtype, size_t i) {
  if (dtype == mx::float32) return static_cast<const float*>(p)[i];
  if (dtype == mx::bfloat16) {  // the high half of a float32
    uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  }
#if defined(__F16C__)
  return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
#else
  return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
#endif
}

// The rows as float32, each 32-element block of a 4-bit product reordered to how a block's 16 bytes unpack: the
// low nibbles (elements 0, 2, ..., 30), then the high ones (1, 3, ..., 31).
std::vector<float> prepared(const void* x, mx::Dtype dtype, int rows, int k, int bits) {
  std::vector<float> out(static_cast<size_t>(rows) * k);
  for (int m = 0; m < rows; m++) {
    float* row = out.data() + static_cast<size_t>(m) * k;
    for (int i = 0; i < k; i++) {
      int at = i;
      if (bits == 4) {
        int block = i & ~31, j = i & 31;
        at = block + (j & 1) * 16 + j / 2;
      }
      row[at] = as_float(x, dtype, static_cast<size_t>(m) * k + i);
    }
  }
  return out;
}

struct Problem {
  const float* x;  // prepared rows
  const uint32_t* w;
  const void* scales;
  const void* biases;
  mx::Dtype scale_dtype;
  void* out;
  mx::Dtype out_dtype;
  int rows, n, k, group_size, bits;
};

void store(const Problem& p, int m, int col, float value) {
  size_t i = static_cast<size_t>(m) * p.n + col;
  if (p.out_dtype == mx::float32)
    static_cast<float*>(p.out)[i] = value;
  else if (p.out_dtype == mx::float16)
    static_cast<mx::float16_t*>(p.out)[i] = static_cast<mx::float16_t>(value);
  else
    static_cast<mx::bfloat16_t*>(p.out)[i] = static_cast<mx::bfloat16_t>(value);
}

// A column's scales or biases as float32, converted a vector at a time: read once per group in the inner loop.
void row_floats(const void* src, mx::Dtype dtype, size_t at, int count, float* out) {
  int i = 0;
#if defined(__F16C__)
  if (dtype == mx::float16) {
    const uint16_t* h = static_cast<const uint16_t*>(src) + at;
    for (; i + 8 <= count; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
#endif
  for (; i < count; i++) out[i] = as_float(src, dtype, at + i);
}

// Each helper's column scratch: the column's scales, then its biases.
std::vector<float>& scratch(int groups) {
  thread_local std::vector<float> floats;
  if (floats.size() < 2 * static_cast<size_t>(groups)) floats.resize(2 * static_cast<size_t>(groups));
  return floats;
}

// One column's inputs: its packed row, the rows it multiplies, and its scales and biases as float32.
struct Column {
  const uint8_t* w;
  const float* x;
  const float* scales;
  const float* biases;
  int groups;
};

Column column_of(const Problem& p, int first_row, int col, int bits) {
  const int words = p.k * bits / 32, groups = p.k / p.group_size;
  float* scales = scratch(groups).data();
  row_floats(p.scales, p.scale_dtype, static_cast<size_t>(col) * groups, groups, scales);
  row_floats(p.biases, p.scale_dtype, static_cast<size_t>(col) * groups, groups, scales + groups);
  return {reinterpret_cast<const uint8_t*>(p.w + static_cast<size_t>(col) * words),
          p.x + static_cast<size_t>(first_row) * p.k, scales, scales + groups, groups};
}

#if defined(__AVX512F__)

template <int M, int BITS>
void column(const Problem& p, int first_row, int col) {
  constexpr int STEP = BITS == 4 ? 32 : 16;  // elements one 16-byte load holds
  const Column c = column_of(p, first_row, col, BITS);
  const uint8_t* w = c.w;
  const float *x = c.x, *scales = c.scales, *biases = c.biases;
  const int groups = c.groups;
  __m512 even[M], odd[M];
  for (int m = 0; m < M; m++) even[m] = odd[m] = _mm512_setzero_ps();
  // 4 bits take one of 16 values per group: the group's table of them, dequantized once, and each element looked
  // up by its nibble (a lane's low 4 bits index the table, whatever its higher bits hold).
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int g = 0; g < groups; g++) {
    const __m512 scale = _mm512_set1_ps(scales[g]), bias = _mm512_set1_ps(biases[g]);
    const __m512 table = _mm512_fmadd_ps(values, scale, bias);
    for (int i = g * p.group_size; i < (g + 1) * p.group_size; i += STEP) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * BITS / 8));
      _mm_prefetch(reinterpret_cast<const char*>(w + i * BITS / 8) + PREFETCH_BYTES, _MM_HINT_T0);
      if constexpr (BITS == 4) {
        const __m512i lanes = _mm512_cvtepu8_epi32(bytes);
        __m512 a = _mm512_permutexvar_ps(lanes, table);                         // the low nibbles
        __m512 b = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table);  // the high ones
        for (int m = 0; m < M; m++) {
          even[m] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + static_cast<size_t>(m) * p.k + i), even[m]);
          odd[m] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + static_cast<size_t>(m) * p.k + i + 16), odd[m]);
        }
      } else {
        __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), scale, bias);
        for (int m = 0; m < M; m++)
          even[m] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + static_cast<size_t>(m) * p.k + i), even[m]);
      }
    }
  }
  for (int m = 0; m < M; m++) store(p, first_row + m, col, _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])));
}

#elif defined(__AVX2__)

float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int M, int BITS>
void column(const Problem& p, int first_row, int col) {
  constexpr int STEP = BITS == 4 ? 32 : 8;
  const Column c = column_of(p, first_row, col, BITS);
  const uint8_t* w = c.w;
  const float *x = c.x, *scales = c.scales, *biases = c.biases;
  const int groups = c.groups;
  __m256 even[M], odd[M];
  for (int m = 0; m < M; m++) even[m] = odd[m] = _mm256_setzero_ps();
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int g = 0; g < groups; g++) {
    const __m256 scale = _mm256_set1_ps(scales[g]), bias = _mm256_set1_ps(biases[g]);
    for (int i = g * p.group_size; i < (g + 1) * p.group_size; i += STEP) {
      if constexpr (BITS == 4) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i / 2));
        __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        __m256 parts[4] = {
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), scale, bias),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), scale, bias),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), scale, bias),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), scale, bias),
        };
        for (int m = 0; m < M; m++) {
          const float* r = x + static_cast<size_t>(m) * p.k + i;
          even[m] = _mm256_fmadd_ps(parts[0], _mm256_loadu_ps(r), even[m]);
          odd[m] = _mm256_fmadd_ps(parts[1], _mm256_loadu_ps(r + 8), odd[m]);
          even[m] = _mm256_fmadd_ps(parts[2], _mm256_loadu_ps(r + 16), even[m]);
          odd[m] = _mm256_fmadd_ps(parts[3], _mm256_loadu_ps(r + 24), odd[m]);
        }
      } else {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i));
        __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), scale, bias);
        for (int m = 0; m < M; m++)
          even[m] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + static_cast<size_t>(m) * p.k + i), even[m]);
      }
    }
  }
  for (int m = 0; m < M; m++) store(p, first_row + m, col, sum8(_mm256_add_ps(even[m], odd[m])));
}

#else  // no x86 SIMD here (64-bit ARM among them): plain loops, which the compiler vectorizes as it can

template <int M, int BITS>
void column(const Problem& p, int first_row, int col) {
  const int words = p.k * BITS / 32, groups = p.k / p.group_size;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w + static_cast<size_t>(col) * words);
  const float* x = p.x + static_cast<size_t>(first_row) * p.k;
  float acc[M] = {};
  for (int g = 0; g < groups; g++) {
    size_t at = static_cast<size_t>(col) * groups + g;
    const float scale = as_float(p.scales, p.scale_dtype, at), bias = as_float(p.biases, p.scale_dtype, at);
    for (int i = g * p.group_size; i < (g + 1) * p.group_size; i++) {
      float value;
      int slot = i;  // where element i's row value sits in the prepared rows
      if constexpr (BITS == 4) {
        value = static_cast<float>((w[i / 2] >> (4 * (i & 1))) & 0x0F);
        int block = i & ~31, j = i & 31;
        slot = block + (j & 1) * 16 + j / 2;
      } else {
        value = static_cast<float>(w[i]);
      }
      const float dequantized = value * scale + bias;
      for (int m = 0; m < M; m++) acc[m] += dequantized * x[static_cast<size_t>(m) * p.k + slot];
    }
  }
  for (int m = 0; m < M; m++) store(p, first_row + m, col, acc[m]);
}

#endif

// The cores a product may use (``set_cores``): as many threads, each helper free to run on any of them. The
// calling thread (MLX's stream thread) stays where it is: a rank alone may pin it to one core beside the thread
// that hands it the work (neuron/system/cpu.py, one_core), and the helpers must not inherit that one core.
std::vector<int> cores;
std::atomic<int> placement{0};  // bumped by each set_cores: helpers placed under an older one place themselves again

void place_helper() {
  thread_local int placed = 0;
  const int wanted = placement.load();
  if (omp_get_thread_num() == 0 || placed == wanted || cores.empty()) return;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  for (int core : cores) CPU_SET(core, &mask);
  sched_setaffinity(0, sizeof mask, &mask);
  placed = wanted;
}

void set_cores(const std::vector<int>& given) {
  cores = given;
  placement++;
  omp_set_num_threads(cores.empty() ? 1 : static_cast<int>(cores.size()));
}

template <int M>
void columns(const Problem& p, int first_row) {
#pragma omp parallel
  {
    place_helper();
    if (p.bits == 4) {
#pragma omp for schedule(static)
      for (int col = 0; col < p.n; col++) column<M, 4>(p, first_row, col);
    } else {
#pragma omp for schedule(static)
      for (int col = 0; col < p.n; col++) column<M, 8>(p, first_row, col);
    }
  }
}

void multiply(const Problem& p) {
  for (int first = 0; first < p.rows; first += MAX_ROWS) {
    switch (std::min(MAX_ROWS, p.rows - first)) {
      case 1: columns<1>(p, first); break;
      case 2: columns<2>(p, first); break;
      case 3: columns<3>(p, first); break;
      case 4: columns<4>(p, first); break;
      case 5: columns<5>(p, first); break;
      case 6: columns<6>(p, first); break;
      case 7: columns<7>(p, first); break;
      default: columns<8>(p, first); break;
    }
  }
}

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &x = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int k = x.shape(-1), n = w.shape(0), rows = static_cast<int>(x.size() / k);
    encoder.dispatch([x, w, scales, biases, out, k, n, rows, group_size = group_size_, bits = bits_]() mutable {
      std::vector<float> rows_prepared = prepared(x.data<void>(), x.dtype(), rows, k, bits);
      Problem p{rows_prepared.data(), w.data<uint32_t>(), scales.data<void>(), biases.data<void>(), scales.dtype(),
                out.data<void>(), out.dtype(), rows, n, k, group_size, bits};
      multiply(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("quantized_rows runs on the CPU only");
  }

  const char* name() const override { return "QuantizedRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedRows&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 private:
  int group_size_, bits_;
};

mx::array quantized_rows(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                         int group_size, int bits, mx::StreamOrDevice s) {
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
  for (const auto& a : {x, w, scales, biases}) inputs.push_back(mx::contiguous(a, false, stream));
  return mx::array(std::move(shape), x.dtype(), std::make_shared<QuantizedRows>(stream, group_size, bits),
                   std::move(inputs));
}

}  // namespace

NB_MODULE(_quantized, m) {
  m.doc() = "x @ dequantize(w).T for a few rows of x, on the CPU, against MLX's affine 4- and 8-bit layouts";
  m.def("quantized_rows", &quantized_rows, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "x @ dequantize(w, scales, biases).T (as mlx.core.quantized_matmul with transpose=True)");
  m.def("threads", []() { return omp_get_max_threads(); }, "the threads a product runs on");
  m.def("set_cores", &set_cores, nb::arg("cores"), "run the products on these cores, a thread for each");
}
