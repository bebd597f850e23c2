"""``POST /v1/completions``: ``routes`` (the handler, its endpoint and OpenAPI paths), ``parse`` (the body's
checks), ``render`` (the reply's choices), ``schema`` (the body and reply in the OpenAPI document)."""
