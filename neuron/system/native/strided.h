// Reading an MLX array where it lies, whatever its strides (quantized.cpp and layers.cpp): a copy to make it
// contiguous first would be one more node in MLX's graph, and a small model's decode step is mostly its nodes.
#pragma once

#include <cstdint>

#include "mlx/array.h"

// Where element ``i`` of ``a`` (counted in row-major order) sits in its buffer; strides may be negative (a reversed
// view).
inline int64_t offset_of(const mlx::core::array& a, int64_t i) {
  int64_t at = 0;
  for (int d = static_cast<int>(a.ndim()) - 1; d >= 0; d--) {
    at += (i % a.shape(d)) * static_cast<int64_t>(a.strides()[d]);
    i /= a.shape(d);
  }
  return at;
}
