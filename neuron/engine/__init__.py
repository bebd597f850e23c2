"""The engine: scheduling, detokenizing and stop strings, above the pool.

``engine.py`` runs the one step loop that owns the pool; ``sequence.py`` holds
one request's state and the events it streams back. The modules are imported
by path, so that the MLX-free ``sequence`` can be used without loading MLX.
"""
