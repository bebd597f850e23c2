"""Everything that touches MLX for one rank: its group, its share of the model, its KV caches, and rank 0's sampler."""
