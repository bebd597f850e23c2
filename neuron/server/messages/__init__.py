"""Anthropic's Messages API, ``POST /v1/messages`` and ``/v1/messages/count_tokens``: ``routes`` (the handlers,
their endpoints and OpenAPI paths), ``parse`` (the body as a chat body, errors under this API's names),
``render`` (the Message, its events and Anthropic's error shape), ``schema`` (the bodies and replies in the
OpenAPI document)."""
