"""neuron: a tensor-parallel LLM inference server on MLX."""

__version__ = "0.1.0"
