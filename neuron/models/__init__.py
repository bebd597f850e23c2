"""Where a model comes from: a folder, the Hugging Face Hub, a GGUF file, LoRA adapters, the shares pushed to
hosts, the cache of models, and what each architecture supports. No MLX."""
