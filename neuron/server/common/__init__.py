"""What the server's API families share, and no family's own: errors, typed reads of a body, the generation and
chat checks, message content parts, handing a request to the engine, replies made of choices, tools, reasoning,
limits on request JSON, and the helpers each family's OpenAPI part is written with. Imports no family."""
