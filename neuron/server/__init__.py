"""The HTTP server: OpenAI's API over the engine. ``app`` and ``openai`` never import MLX; ``serve`` wires it up."""
