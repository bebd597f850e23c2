"""The leader as a router: several models in one server, each an ``neuron serve`` of its own on loopback.

Why a process per model: MLX keeps one distributed group per process, and forgetting it is process-wide
(``rank.dist.group``), so two split models cannot both keep rank 0 in one leader; and a process of its own keeps
one model's recovery (its group lost, its leader re-executed) from touching another's streams. llama.cpp's router
runs one server per model for the same reasons. The router holds no model and imports no MLX: it declares the
models (``declared``), decides which stay resident (``residency``), starts and stops their servers (``child``),
and forwards each request to the one its body names (``app``). ``run`` is its process.
"""
