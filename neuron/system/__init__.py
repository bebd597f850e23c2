"""The machine a process runs on: the CPU's fast path, the device MLX computes on, native kernels, descriptors,
systemd, the one re-execution and the paths. No MLX."""
