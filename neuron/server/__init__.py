"""The HTTP server: OpenAI's and Anthropic's APIs over the engine, no MLX. ``app`` puts the routes together;
``http`` is the request's skeleton; each API family (``chat_completions``, ``completions``, ``responses``,
``messages``, ``embeddings``, ``tokenize``, ``models``, ``health``) holds its checks, replies and OpenAPI part;
``common`` holds what they share. ``neuron.cli.serve`` serves it."""
