"""A rank's share of the model: loading its slice or its stage, the split plans, fused projections, LoRA, M-RoPE
positions and a vision-language model's images."""
