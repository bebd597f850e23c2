"""Everything that touches MLX for one rank: its group, its model shard, its KV cache, and rank 0's sampler."""
