"""``POST /v1/responses``, OpenAI's Responses API: ``routes`` (the handler, its endpoint and OpenAPI paths),
``parse`` (the body as a chat body, errors under this API's names), ``render`` (the Response object and its
events), ``schema`` (the body and reply in the OpenAPI document)."""
