// The quantized kernel's products (neuron/system/native/quantized.h) against a plain reference, built for an
// instruction set this machine may not have and run under emulation (test_kernel.py: 64-bit ARM's NEON under
// qemu-user). Says which path it was built with, and exits 1 naming each case that differs.

#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "quantized.h"

namespace {

const char* built_path() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "plain";
#endif
}

// Scales or biases held in ``dtype``, and the float32 values they hold.
struct Held {
  std::vector<float> values;
  std::vector<uint16_t> half;  // float16 or bfloat16 bits

  Held(const std::vector<float>& wanted, mx::Dtype dtype) {
    for (float v : wanted) {
      if (dtype == mx::float16) {
        mx::float16_t h(v);
        half.push_back(*reinterpret_cast<uint16_t*>(&h));
        values.push_back(static_cast<float>(h));
      } else if (dtype == mx::bfloat16) {
        mx::bfloat16_t h(v);
        half.push_back(*reinterpret_cast<uint16_t*>(&h));
        values.push_back(static_cast<float>(h));
      } else {
        values.push_back(v);
      }
    }
  }

  const void* data() const { return half.empty() ? static_cast<const void*>(values.data()) : half.data(); }
};

// The largest difference from the reference, relative to its largest value.
double check(int n, int k, int rows, int bits, int group, mx::Dtype dtype, std::mt19937& random) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<uint32_t> w(static_cast<size_t>(n) * k * bits / 32);
  for (auto& word : w) word = random();
  std::vector<float> scales(static_cast<size_t>(n) * k / group), biases(scales.size());
  for (size_t i = 0; i < scales.size(); i++) scales[i] = 0.1f * uniform(random), biases[i] = 0.1f * uniform(random);
  const Held held_scales(scales, dtype), held_biases(biases, dtype);
  std::vector<float> x(static_cast<size_t>(rows) * k), ready(x.size());
  for (auto& v : x) v = uniform(random);
  for (int m = 0; m < rows; m++)
    for (int i = 0; i < k; i++) ready[static_cast<size_t>(m) * k + prepared_slot(i, bits)] = x[static_cast<size_t>(m) * k + i];
  std::vector<float> out(static_cast<size_t>(rows) * n);
  Problem p{ready.data(), w.data(), held_scales.data(), held_biases.data(), dtype, out.data(), mx::float32,
            rows, n, k, group, bits};
  multiply(p);
  const int per_word = 32 / bits;
  double worst = 0.0, largest = 0.0;
  for (int m = 0; m < rows; m++)
    for (int col = 0; col < n; col++) {
      double want = 0.0;
      for (int i = 0; i < k; i++) {
        const uint32_t word = w[(static_cast<size_t>(col) * k + i) / per_word];
        const double q = (word >> (bits * (i % per_word))) & ((1u << bits) - 1);
        const size_t at = static_cast<size_t>(col) * (k / group) + i / group;
        want += x[static_cast<size_t>(m) * k + i] * (q * held_scales.values[at] + held_biases.values[at]);
      }
      worst = std::max(worst, std::abs(out[static_cast<size_t>(m) * n + col] - want));
      largest = std::max(largest, std::abs(want));
    }
  return worst / largest;
}

}  // namespace

int main() {
  std::mt19937 random(7);
  set_cores({0, 1});  // two helpers where a product is large enough to share
  int failures = 0, cases = 0;
  const mx::Dtype dtypes[] = {mx::float32, mx::float16, mx::bfloat16};
  for (int bits : {4, 8})
    for (int group : {32, 64, 128})
      for (const mx::Dtype& dtype : dtypes)
        for (int rows : {1, 3, 8, 11}) {
          const double error = check(37, 384, rows, bits, group, dtype, random);
          cases++;
          if (!(error < 2e-6)) {
            failures++;
            std::printf("differs: bits %d, group %d, scales of %d bytes, rows %d: %g\n", bits, group, dtype.size(),
                        rows, error);
          }
        }
  // Past the size a product is shared at; and a prompt's rows, dequantized into the BLAS where one is linked in.
  for (const auto& [n, rows, bits] : {std::tuple{1024, 2, 4}, std::tuple{96, 100, 4}, std::tuple{96, 100, 8}}) {
    const double error = check(n, 512, rows, bits, 64, mx::bfloat16, random);
    cases++;
    if (!(error < 2e-6)) failures++, std::printf("differs: %d columns, %d rows, %d bits: %g\n", n, rows, bits, error);
  }
  // Rows and scales in float16 and bfloat16 as the kernel reads them, against MLX's own conversions.
  for (float v : {0.0f, -1.5f, 3.1415926f, 65504.0f, 1e-6f}) {
    const mx::float16_t h(v);
    const mx::bfloat16_t b(v);
    cases++;
    if (as_float(&h, mx::float16, 0) != static_cast<float>(h) || as_float(&b, mx::bfloat16, 0) != static_cast<float>(b))
      failures++, std::printf("differs: %g read from float16 or bfloat16\n", v);
  }
  std::printf("%s, BLAS %s: %d of %d cases differ\n", built_path(), sgemm() ? "linked" : "absent", failures, cases);
  return failures == 0 ? 0 : 1;
}
