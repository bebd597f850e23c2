// A primitive's evaluation on MLX's CPU stream (quantized.cpp and layers.cpp): its output allocated, its arrays
// handed to the stream's encoder (which keeps them alive until the work has run), and the work queued on the stream.
#pragma once

#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

template <class Work>
void queue_on_cpu(mlx::core::Stream stream, const std::vector<mlx::core::array>& inputs, mlx::core::array& out,
                  Work&& work) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch(std::forward<Work>(work));
}
