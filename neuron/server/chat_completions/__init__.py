"""``POST /v1/chat/completions``: ``routes`` (the handler, its endpoint and OpenAPI paths), ``render`` (the reply's
choices), ``schema`` (the body and reply in the OpenAPI document). The chat body's checks are ``common.chat``'s,
shared with the Responses and Messages families, which are chats under other names."""
