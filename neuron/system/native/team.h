// The cores a rank's kernel work may use (``set_cores``, quantized.h), for every parallel region of the kernel's
// sources (quantized.h's products, attention.cpp's heads): one definition across them.
#pragma once

#include <omp.h>
#include <sched.h>

#include <atomic>
#include <vector>

namespace neuron {

// As many threads as cores, each helper free to run on any of them. The calling thread (MLX's stream thread) stays
// where it is: a rank alone may pin it to one core beside the thread that hands it the work (neuron/system/cpu.py,
// one_core), and the helpers must not inherit that one core.
inline std::vector<int> cores;
inline std::atomic<int> placement{0};  // bumped by each set_cores: helpers placed under an older one place themselves again

// The threads a parallel region runs on, named in each: OpenMP's own count is per thread (set_cores runs on the
// rank's thread, the work on MLX's stream thread), and its default is the cores the process was allowed when the
// runtime loaded, one where the rank's thread was already pinned to its core.
inline int team() { return cores.empty() ? 1 : static_cast<int>(cores.size()); }

// Called first in each parallel region: a helper moves to the rank's cores once after each set_cores.
inline void place_helper() {
  thread_local int placed = 0;
  const int wanted = placement.load();
  if (omp_get_thread_num() == 0 || placed == wanted || cores.empty()) return;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  for (int core : cores) CPU_SET(core, &mask);
  sched_setaffinity(0, sizeof mask, &mask);
  placed = wanted;
}

}  // namespace neuron
