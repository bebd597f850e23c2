"""A rank's share of the model: loading its slice of every layer or its stage, the tensor-parallel splits, fused
projections, LoRA, M-RoPE positions and a vision-language model's images."""
