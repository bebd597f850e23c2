"""A rank's KV caches: every kind mlx-lm builds, quantized ones, the batch's micro-batches, prefix-cache entries
and their files, and what a rejected draft takes back."""
