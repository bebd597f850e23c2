"""A check for schemathesis, loaded by name through ``SCHEMATHESIS_HOOKS``.

It stands in for schemathesis's own ``positive_data_acceptance``, less the one
limits no JSON schema can state: how many tokens a prompt becomes (OpenAI's
``context_length_exceeded``), whether the grammar engine can enforce a JSON
schema sent in ``response_format`` or a tool's parameters (``unsupported_schema``),
whether ``tool_choice`` names one of the ``tools`` (``tool_not_found``), and whether ``min_tokens`` is
at most ``max_tokens`` (``min_tokens_above_max_tokens``). A
schema-valid body may answer 400 only with one of those codes.
"""

from __future__ import annotations

import schemathesis

CODES = ("context_length_exceeded", "unsupported_schema", "tool_not_found", "min_tokens_above_max_tokens")
# Anthropic's error body has no code: the same refusals, told by their messages (neuron/engine/intake.py,
# server/common/submit.py, server/common/tools.py).
MESSAGES = ("but the context holds", "the schema cannot be enforced", "must name one of the tools given")


@schemathesis.check
def valid_requests_are_served(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return
    body = response.json()
    error = body.get("error", {})
    if body.get("type") == "error" and any(m in error.get("message", "") for m in MESSAGES):
        return
    if error.get("code") not in CODES:
        raise AssertionError(f"a schema-valid request was refused: {error.get('message')}")
