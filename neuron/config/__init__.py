"""Every setting: what a setting is, their declarations, and the sources they are read from (file, environment,
flags). No MLX."""
