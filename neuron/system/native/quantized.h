// The quantized kernel's computing, free of MLX's arrays and graph (quantized.cpp wraps it as an MLX primitive):
// included once by quantized.cpp, and by the test that builds it for another instruction set to run under
// emulation (tests/e2e/quantized/kernel_check.cpp).
//
// Why: a decode step multiplies one row per sequence by every weight matrix once, so its time is the weights' bytes
// over the memory's bandwidth. MLX's CPU quantized_matmul reads 4-bit weights slower than fp32 BLAS reads fp32 ones
// (one thread, and a dequantize per element with no SIMD), which throws the quantization's gain away. This reads
// each packed word once, dequantizes it in registers (scale * q + bias, as MLX defines the layout), and multiplies
// it into every row, on every core of the rank.
//
// Paths, by the instruction set it is built for (the machine's own): AVX-512 (a 16-value table per group, looked up
// by nibble, four columns at once), AVX2 with FMA and F16C, NEON on 64-bit ARM (unpacked and dequantized in
// registers), else plain loops. tests/e2e/quantized/test_kernel.py checks each here, NEON under qemu-user. On
// AVX-512, a model's 4- and 8-bit weights are packed at load for a faster product (``pack``, below).
//
// Layout (mlx.core.quantize): w is uint32 [N, K * bits / 32], element k of a row in bits [bits * (k % (32 / bits)),
// ...) of word k / (32 / bits); scales and biases are [N, K / group_size]; the result is x @ dequantize(w).T.

#pragma once

#include <dlfcn.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "mlx/dtype.h"
#include "mlx/types/half_types.h"
#include "team.h"

namespace mx = mlx::core;

namespace {

constexpr int MAX_ROWS = 8;  // rows multiplied per pass over the weights; more take further passes
#ifndef THREADED_BYTES
#define THREADED_BYTES (256 << 10)  // weights in a block of a prompt's product from which its dequantizing is shared
#endif
// Packed weights (times rows) from which a few rows' product is shared among the helpers. Lower, on two cores where
// the rank's Python takes the second, a small model's step was slower: each shared product of SmolLM2's layers
// (30-60 microseconds) waited on a helper that was not running (BENCHMARKS.md, "Quantized weights on the CPU");
// its head (14-28 MB) and a large model's every product are shared.
#ifndef SHARED_BYTES
#define SHARED_BYTES (4 << 20)
#endif
#ifndef BLAS_ROWS
#define BLAS_ROWS 64  // rows from which a product is dequantized into BLAS (``through_blas``)
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048  // how far ahead of its reads a helper asks for the weights it reads next
#endif

float as_float(const void* p, mx::Dtype dtype, int64_t i) {
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

// Where element i of a row sits in its prepared copy: each 32-element block of a 4-bit product reordered to how
// a block's 16 bytes unpack, the low nibbles (elements 0, 2, ..., 30), then the high ones (1, 3, ..., 31).
inline int prepared_slot(int i, int bits) {
  if (bits != 4) return i;
  const int block = i & ~31, j = i & 31;
  return block + (j & 1) * 16 + j / 2;
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
  bool packed = false;  // w, scales and biases interleaved by ``pack`` (an AVX-512 build)
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

// Each helper's scratch for the columns it works on: their scales, then their biases, as float32.
float* scratch(size_t count) {
  thread_local std::vector<float> floats;
  if (floats.size() < count) floats.resize(count);
  return floats.data();
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
  float* scales = scratch(2 * static_cast<size_t>(groups));
  row_floats(p.scales, p.scale_dtype, static_cast<size_t>(col) * groups, groups, scales);
  row_floats(p.biases, p.scale_dtype, static_cast<size_t>(col) * groups, groups, scales + groups);
  return {reinterpret_cast<const uint8_t*>(p.w + static_cast<size_t>(col) * words),
          p.x + static_cast<size_t>(first_row) * p.k, scales, scales + groups, groups};
}

#if defined(__AVX512F__)

// C consecutive columns at once: each row's loads of x serve every one of them, and their C x M sums are
// independent chains the core overlaps (one column's sums wait on each other's latency).
template <int M, int BITS, int C>
void block(const Problem& p, int first_row, int col) {
  constexpr int STEP = BITS == 4 ? 32 : 16;  // elements one 16-byte load holds
  const int words = p.k * BITS / 32, groups = p.k / p.group_size;
  float* floats = scratch(2 * static_cast<size_t>(C) * groups);
  const uint8_t* w[C];
  for (int c = 0; c < C; c++) {
    w[c] = reinterpret_cast<const uint8_t*>(p.w + static_cast<size_t>(col + c) * words);
    row_floats(p.scales, p.scale_dtype, static_cast<size_t>(col + c) * groups, groups, floats + c * groups);
    row_floats(p.biases, p.scale_dtype, static_cast<size_t>(col + c) * groups, groups, floats + (C + c) * groups);
  }
  // The next block's scales and biases but one, asked for now: they are streams of their own beside the packed
  // words, and SmolLM2's products waited on them for about a fifth of their time (BENCHMARKS.md). A prefetch
  // past the arrays' end (the last blocks') never faults.
  const size_t scale_bytes = p.scale_dtype.size(), ahead = static_cast<size_t>(col + 2 * C) * groups * scale_bytes;
  for (size_t at = 0; at < static_cast<size_t>(C) * groups * scale_bytes; at += 64) {
    _mm_prefetch(static_cast<const char*>(p.scales) + ahead + at, _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(p.biases) + ahead + at, _MM_HINT_T0);
  }
  const float* x = p.x + static_cast<size_t>(first_row) * p.k;
  __m512 even[M][C], odd[M][C];
  for (int m = 0; m < M; m++)
    for (int c = 0; c < C; c++) even[m][c] = odd[m][c] = _mm512_setzero_ps();
  // 4 bits take one of 16 values per group: the group's table of them, dequantized once, and each element looked
  // up by its nibble (a lane's low 4 bits index the table, whatever its higher bits hold).
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int g = 0; g < groups; g++) {
    __m512 scale[C], bias[C];
    for (int c = 0; c < C; c++) {
      scale[c] = _mm512_set1_ps(floats[c * groups + g]);
      bias[c] = _mm512_set1_ps(floats[(C + c) * groups + g]);
      if constexpr (BITS == 4) scale[c] = _mm512_fmadd_ps(values, scale[c], bias[c]);  // the table
    }
    for (int i = g * p.group_size; i < (g + 1) * p.group_size; i += STEP) {
      __m512 xa[M], xb[M];
      for (int m = 0; m < M; m++) {
        xa[m] = _mm512_loadu_ps(x + static_cast<size_t>(m) * p.k + i);
        if constexpr (BITS == 4) xb[m] = _mm512_loadu_ps(x + static_cast<size_t>(m) * p.k + i + 16);
      }
      for (int c = 0; c < C; c++) {
        const uint8_t* at = w[c] + i * BITS / 8;
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
        _mm_prefetch(reinterpret_cast<const char*>(at) + PREFETCH_BYTES, _MM_HINT_T0);
        if constexpr (BITS == 4) {
          const __m512i lanes = _mm512_cvtepu8_epi32(bytes);
          const __m512 a = _mm512_permutexvar_ps(lanes, scale[c]);                         // the low nibbles
          const __m512 b = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), scale[c]);  // the high ones
          for (int m = 0; m < M; m++) {
            even[m][c] = _mm512_fmadd_ps(a, xa[m], even[m][c]);
            odd[m][c] = _mm512_fmadd_ps(b, xb[m], odd[m][c]);
          }
        } else {
          const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), scale[c], bias[c]);
          for (int m = 0; m < M; m++) even[m][c] = _mm512_fmadd_ps(a, xa[m], even[m][c]);
        }
      }
    }
  }
  for (int m = 0; m < M; m++)
    for (int c = 0; c < C; c++)
      store(p, first_row + m, col + c, _mm512_reduce_add_ps(_mm512_add_ps(even[m][c], odd[m][c])));
}

constexpr int columns_at_once(int rows) { return rows <= 2 ? 4 : 1; }  // as many sums as registers hold

#elif defined(__AVX2__)

constexpr int columns_at_once(int) { return 1; }

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

#elif defined(__ARM_NEON)

constexpr int columns_at_once(int) { return 1; }

// Four bytes' values as float32, dequantized: scale * q + bias.
inline float32x4_t dequantized4(uint16x4_t q, float32x4_t scale, float32x4_t bias) {
  return vfmaq_f32(bias, vcvtq_f32_u32(vmovl_u16(q)), scale);
}

// 64-bit ARM: unpack and dequantize in registers, as the AVX2 path does (a table lookup by nibble would need the
// table's 64 bytes in four registers, where a widening and a multiply-add are two instructions).
template <int M, int BITS>
void column(const Problem& p, int first_row, int col) {
  constexpr int STEP = BITS == 4 ? 32 : 16;  // elements one 16-byte load holds
  const Column c = column_of(p, first_row, col, BITS);
  float32x4_t even[M], odd[M];
  for (int m = 0; m < M; m++) even[m] = odd[m] = vdupq_n_f32(0.0f);
  const uint8x16_t nibble = vdupq_n_u8(0x0F);
  for (int g = 0; g < c.groups; g++) {
    const float32x4_t scale = vdupq_n_f32(c.scales[g]), bias = vdupq_n_f32(c.biases[g]);
    for (int i = g * p.group_size; i < (g + 1) * p.group_size; i += STEP) {
      const uint8x16_t bytes = vld1q_u8(c.w + i * BITS / 8);
      // A 4-bit block's low nibbles are its prepared row's first 16 values, its high ones the next 16.
      uint8x16_t halves[2] = {bytes, bytes};
      if constexpr (BITS == 4) halves[0] = vandq_u8(bytes, nibble), halves[1] = vshrq_n_u8(bytes, 4);
      for (int h = 0; h < (BITS == 4 ? 2 : 1); h++) {
        const uint16x8_t low = vmovl_u8(vget_low_u8(halves[h])), high = vmovl_u8(vget_high_u8(halves[h]));
        const float32x4_t parts[4] = {dequantized4(vget_low_u16(low), scale, bias),
                                      dequantized4(vget_high_u16(low), scale, bias),
                                      dequantized4(vget_low_u16(high), scale, bias),
                                      dequantized4(vget_high_u16(high), scale, bias)};
        for (int m = 0; m < M; m++) {
          const float* r = c.x + static_cast<size_t>(m) * p.k + i + 16 * h;
          even[m] = vfmaq_f32(even[m], parts[0], vld1q_f32(r));
          odd[m] = vfmaq_f32(odd[m], parts[1], vld1q_f32(r + 4));
          even[m] = vfmaq_f32(even[m], parts[2], vld1q_f32(r + 8));
          odd[m] = vfmaq_f32(odd[m], parts[3], vld1q_f32(r + 12));
        }
      }
    }
  }
  for (int m = 0; m < M; m++) store(p, first_row + m, col, vaddvq_f32(vaddq_f32(even[m], odd[m])));
}

#else  // neither x86's SIMD nor ARM's: plain loops, which the compiler vectorizes as it can

constexpr int columns_at_once(int) { return 1; }

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
      const int slot = prepared_slot(i, BITS);  // where element i's row value sits in the prepared rows
      if constexpr (BITS == 4) {
        value = static_cast<float>((w[i / 2] >> (4 * (i & 1))) & 0x0F);
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

#if !defined(__AVX512F__)
template <int M, int BITS, int C>
void block(const Problem& p, int first_row, int col) {
  for (int c = 0; c < C; c++) column<M, BITS>(p, first_row, col + c);
}
#endif

using neuron::cores;  // team.h: the rank's cores, shared with attention.cpp's parallel regions
using neuron::place_helper;
using neuron::placement;
using neuron::team;

// How many threads a shared product runs on, from the calling thread: a parallel region entered as the products
// enter theirs, counted.
inline int threads() {
  int count = 1;
#pragma omp parallel num_threads(team())
  {
#pragma omp single
    count = omp_get_num_threads();
  }
  return count;
}

void set_cores(const std::vector<int>& given) {
  cores = given;
  placement++;
}

template <int M, int BITS>
void columns_of(const Problem& p, int first_row) {
  constexpr int C = columns_at_once(M);
  const int blocks = (p.n + C - 1) / C;
#pragma omp for schedule(static)
  for (int b = 0; b < blocks; b++) {
    const int col = b * C;
    if (col + C <= p.n) {
      block<M, BITS, C>(p, first_row, col);
    } else {  // the last columns, fewer than a block
      for (int c = col; c < p.n; c++) block<M, BITS, 1>(p, first_row, c);
    }
  }
}

template <int M>
void columns(const Problem& p, int first_row) {
  // A small product is done before helpers would have woken: the calling thread does it alone.
  const bool shared = static_cast<size_t>(p.n) * p.k * p.bits / 8 * M >= SHARED_BYTES;
#pragma omp parallel if (shared) num_threads(team())
  {
    place_helper();
    if (p.bits == 4)
      columns_of<M, 4>(p, first_row);
    else
      columns_of<M, 8>(p, first_row);
  }
}

// Many rows (a prompt's chunk): each weight serves every row, which a BLAS's sgemm does best. The weights are
// dequantized a block of columns at a time into float32, in the order the rows were prepared in (so the sums are
// the same products), and the block multiplied by the process's cblas_sgemm (the BLAS MLX uses, found at run time).
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
constexpr size_t BLOCK_BYTES = 4 << 20;  // float32 weights dequantized at once

Sgemm sgemm() {
  static const Sgemm found = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return found;
}

void packed_column(const Problem& p, int col, float* row);

void dequantize(const Problem& p, int first, int count, float* out) {
  if (p.packed) {
#pragma omp parallel for schedule(static) if (static_cast<size_t>(count) * p.k >= THREADED_BYTES) num_threads(team())
    for (int c = 0; c < count; c++) packed_column(p, first + c, out + static_cast<size_t>(c) * p.k);
    return;
  }
  const int words = p.k * p.bits / 32, groups = p.k / p.group_size;
#pragma omp parallel for schedule(static) if (static_cast<size_t>(count) * p.k >= THREADED_BYTES) num_threads(team())
  for (int c = 0; c < count; c++) {
    const int col = first + c;
    const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w + static_cast<size_t>(col) * words);
    float* row = out + static_cast<size_t>(c) * p.k;
#if defined(__AVX512F__)
    float* floats = scratch(2 * static_cast<size_t>(groups));
    row_floats(p.scales, p.scale_dtype, static_cast<size_t>(col) * groups, groups, floats);
    row_floats(p.biases, p.scale_dtype, static_cast<size_t>(col) * groups, groups, floats + groups);
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int g = 0; g < groups; g++) {
      const __m512 scale = _mm512_set1_ps(floats[g]), bias = _mm512_set1_ps(floats[groups + g]);
      const __m512 table = _mm512_fmadd_ps(values, scale, bias);
      for (int i = g * p.group_size; i < (g + 1) * p.group_size; i += p.bits == 4 ? 32 : 16) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * p.bits / 8));
        const __m512i lanes = _mm512_cvtepu8_epi32(bytes);
        if (p.bits == 4) {
          _mm512_storeu_ps(row + i, _mm512_permutexvar_ps(lanes, table));
          _mm512_storeu_ps(row + i + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table));
        } else {
          _mm512_storeu_ps(row + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), scale, bias));
        }
      }
    }
    continue;
#endif
    for (int g = 0; g < groups; g++) {
      const size_t at = static_cast<size_t>(col) * groups + g;
      const float scale = as_float(p.scales, p.scale_dtype, at), bias = as_float(p.biases, p.scale_dtype, at);
      for (int i = g * p.group_size; i < (g + 1) * p.group_size; i++) {
        float q;
        const int slot = prepared_slot(i, p.bits);  // dequantized in the prepared rows' order
        if (p.bits == 4) {
          q = static_cast<float>((w[i / 2] >> (4 * (i & 1))) & 0x0F);
        } else {
          q = static_cast<float>(w[i]);
        }
        row[slot] = q * scale + bias;
      }
    }
  }
}

// Packed weights (``pack``): each block of PACKED_COLUMNS rows (output columns) of w, scales and biases transposed
// in place, so that one 64-byte load holds the same word of 16 columns, a lane each. A decode step's product then
// needs no widening of bytes to lanes and one lookup per 16 weights, where the layout MLX writes needs a widening
// and two lookups per 32 (BENCHMARKS.md, "Weights packed for the lanes"), and each group's scale is applied once to
// the group's sum: s * sum(q * x) + b * sum(x). The block stays where its rows were, so a view of whole blocks (a
// fused group member's rows) is packed too.
constexpr int PACKED_COLUMNS = 16;

constexpr bool packs() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// Each block of PACKED_COLUMNS rows of an [n, width] array of ``size``-byte elements, transposed in place to
// [width, PACKED_COLUMNS].
void interleave(void* data, int n, int width, int size) {
  std::vector<uint8_t> block(static_cast<size_t>(PACKED_COLUMNS) * width * size);
  uint8_t* bytes = static_cast<uint8_t*>(data);
  for (int first = 0; first < n; first += PACKED_COLUMNS) {
    uint8_t* at = bytes + static_cast<size_t>(first) * width * size;
    std::memcpy(block.data(), at, block.size());
    for (int c = 0; c < PACKED_COLUMNS; c++)
      for (int i = 0; i < width; i++)
        std::memcpy(at + (static_cast<size_t>(i) * PACKED_COLUMNS + c) * size,
                    block.data() + (static_cast<size_t>(c) * width + i) * size, size);
  }
}

// Column ``col`` of packed weights, dequantized in order (a packed product's rows are not reordered).
void packed_column(const Problem& p, int col, float* row) {
  const int each = 32 / p.bits, words = p.k / each, groups = p.k / p.group_size, lane = col % PACKED_COLUMNS;
  const uint32_t mask = (1u << p.bits) - 1;
  const size_t first = static_cast<size_t>(col - lane);
  const uint32_t* w = p.w + first * words;
  for (int g = 0; g < groups; g++) {
    const size_t at = first * groups + static_cast<size_t>(g) * PACKED_COLUMNS + lane;
    const float scale = as_float(p.scales, p.scale_dtype, static_cast<int64_t>(at));
    const float bias = as_float(p.biases, p.scale_dtype, static_cast<int64_t>(at));
    for (int i = g * p.group_size / each; i < (g + 1) * p.group_size / each; i++) {
      const uint32_t word = w[static_cast<size_t>(i) * PACKED_COLUMNS + lane];
      for (int e = 0; e < each; e++)
        row[i * each + e] = static_cast<float>((word >> (p.bits * e)) & mask) * scale + bias;
    }
  }
}

#if defined(__AVX512F__)

// A group's 16 scales (or biases), one a lane, as float32.
inline __m512 lane_floats(const void* src, mx::Dtype dtype, size_t at) {
  if (dtype == mx::float32) return _mm512_loadu_ps(static_cast<const float*>(src) + at);
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + at));
  if (dtype == mx::float16) return _mm512_cvtph_ps(half);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));  // bfloat16: a float32's high half
}

// M rows times one block of 16 packed columns. ``sums``: each row's sum over each group.
template <int M, int BITS>
void packed_block(const Problem& p, const float* sums, int first_row, int block) {
  constexpr int CHAINS = M == 1 ? 4 : (M == 2 ? 2 : 1);  // independent sums a row, so that the FMAs overlap
  constexpr int EACH = 32 / BITS;                          // elements a word holds
  const int words = p.k / EACH, groups = p.k / p.group_size, per_group = p.group_size / EACH;
  const size_t first = static_cast<size_t>(block) * PACKED_COLUMNS;
  const uint32_t* w = p.w + first * words;
  const float* x = p.x + static_cast<size_t>(first_row) * p.k;
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 total[M];
  for (int m = 0; m < M; m++) total[m] = _mm512_setzero_ps();
  for (int g = 0; g < groups; g++) {
    __m512 acc[M][CHAINS];
    for (int m = 0; m < M; m++)
      for (int c = 0; c < CHAINS; c++) acc[m][c] = _mm512_setzero_ps();
    for (int i = g * per_group; i < (g + 1) * per_group; i++) {
      const uint32_t* at = w + static_cast<size_t>(i) * PACKED_COLUMNS;
      const __m512i word = _mm512_loadu_si512(at);
      _mm_prefetch(reinterpret_cast<const char*>(at) + PREFETCH_BYTES, _MM_HINT_T0);
      for (int e = 0; e < EACH; e++) {
        __m512 q;
        if constexpr (BITS == 4)  // a lane's low 4 bits index the table, whatever its higher bits hold
          q = _mm512_permutexvar_ps(_mm512_srli_epi32(word, 4 * e), values);
        else  // the top byte needs no mask
          q = _mm512_cvtepi32_ps(e == 3 ? _mm512_srli_epi32(word, 24)
                                        : _mm512_and_si512(_mm512_srli_epi32(word, 8 * e), _mm512_set1_epi32(0xFF)));
        for (int m = 0; m < M; m++)
          acc[m][e % CHAINS] =
              _mm512_fmadd_ps(q, _mm512_set1_ps(x[static_cast<size_t>(m) * p.k + i * EACH + e]), acc[m][e % CHAINS]);
      }
    }
    const size_t at = first * groups + static_cast<size_t>(g) * PACKED_COLUMNS;
    const __m512 scale = lane_floats(p.scales, p.scale_dtype, at), bias = lane_floats(p.biases, p.scale_dtype, at);
    for (int m = 0; m < M; m++) {
      __m512 sum = acc[m][0];
      for (int c = 1; c < CHAINS; c++) sum = _mm512_add_ps(sum, acc[m][c]);
      total[m] = _mm512_fmadd_ps(scale, sum, total[m]);
      total[m] = _mm512_fmadd_ps(bias, _mm512_set1_ps(sums[static_cast<size_t>(first_row + m) * groups + g]), total[m]);
    }
  }
  alignas(64) float lanes[PACKED_COLUMNS];
  for (int m = 0; m < M; m++) {
    _mm512_store_ps(lanes, total[m]);
    for (int c = 0; c < PACKED_COLUMNS; c++) store(p, first_row + m, static_cast<int>(first) + c, lanes[c]);
  }
}

template <int M>
void packed_columns(const Problem& p, const float* sums, int first_row) {
  const int blocks = p.n / PACKED_COLUMNS;
  const bool shared = static_cast<size_t>(p.n) * p.k * p.bits / 8 * M >= SHARED_BYTES;
#pragma omp parallel if (shared) num_threads(team())
  {
    place_helper();
#pragma omp for schedule(static)
    for (int b = 0; b < blocks; b++) {
      if (p.bits == 4)
        packed_block<M, 4>(p, sums, first_row, b);
      else
        packed_block<M, 8>(p, sums, first_row, b);
    }
  }
}

void packed_multiply(const Problem& p) {
  const int groups = p.k / p.group_size;
  std::vector<float> sums(static_cast<size_t>(p.rows) * groups);
  for (int m = 0; m < p.rows; m++)
    for (int g = 0; g < groups; g++) {
      float sum = 0.0f;
      for (int i = g * p.group_size; i < (g + 1) * p.group_size; i++) sum += p.x[static_cast<size_t>(m) * p.k + i];
      sums[static_cast<size_t>(m) * groups + g] = sum;
    }
  for (int first = 0; first < p.rows; first += MAX_ROWS) {
    switch (std::min(MAX_ROWS, p.rows - first)) {
      case 1: packed_columns<1>(p, sums.data(), first); break;
      case 2: packed_columns<2>(p, sums.data(), first); break;
      case 3: packed_columns<3>(p, sums.data(), first); break;
      case 4: packed_columns<4>(p, sums.data(), first); break;
      case 5: packed_columns<5>(p, sums.data(), first); break;
      case 6: packed_columns<6>(p, sums.data(), first); break;
      case 7: packed_columns<7>(p, sums.data(), first); break;
      default: packed_columns<8>(p, sums.data(), first); break;
    }
  }
}

#endif

bool through_blas(const Problem& p) {
  const Sgemm multiply_blocks = sgemm();
  if (multiply_blocks == nullptr || p.rows < BLAS_ROWS) return false;
  int per_block = std::max(1, static_cast<int>(BLOCK_BYTES / (sizeof(float) * p.k)));
  if (p.packed) per_block = std::max(PACKED_COLUMNS, per_block / PACKED_COLUMNS * PACKED_COLUMNS);
  thread_local std::vector<float> weights, sums;
  weights.resize(static_cast<size_t>(std::min(per_block, p.n)) * p.k);
  const bool direct = p.out_dtype == mx::float32;  // else summed here, then converted
  if (!direct) sums.resize(static_cast<size_t>(p.rows) * p.n);
  float* out = direct ? static_cast<float*>(p.out) : sums.data();
  for (int first = 0; first < p.n; first += per_block) {
    const int count = std::min(per_block, p.n - first);
    dequantize(p, first, count, weights.data());
    multiply_blocks(ROW_MAJOR, NO_TRANS, TRANS, p.rows, count, p.k, 1.0f, p.x, p.k, weights.data(), p.k, 0.0f,
                    out + first, p.n);
  }
  if (!direct)
    for (int m = 0; m < p.rows; m++)
      for (int col = 0; col < p.n; col++) store(p, m, col, sums[static_cast<size_t>(m) * p.n + col]);
  return true;
}

void multiply(const Problem& p) {
  if (through_blas(p)) return;
#if defined(__AVX512F__)
  if (p.packed) {
    packed_multiply(p);
    return;
  }
#endif
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

}  // namespace
