"""Rank 0's head: sampling each sequence's tokens, and speculation (a draft model, the model's own prediction
layers, rejection sampling)."""
