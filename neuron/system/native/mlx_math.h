// MLX's own float arithmetic for what layers.cpp and attention.cpp compute lane by lane: its exp and the maximum
// its softmax takes, so that the kernel's activation and softmax give MLX's bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

// The largest of a row's values as MLX's maximum finds it (a value that is no number wins, and stays), in lanes: the
// same value in any order, bar the sign of a zero, which no exp(x - max) can tell.
inline float row_maximum(const float* __restrict a, int64_t n) {
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
