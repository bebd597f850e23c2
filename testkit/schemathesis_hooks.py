"""A check for schemathesis, loaded by name through ``SCHEMATHESIS_HOOKS``.

It stands in for schemathesis's own ``positive_data_acceptance``, less the one
limits no JSON schema can state: how many tokens a prompt becomes (OpenAI's
``context_length_exceeded``), whether the grammar engine can enforce a JSON
schema sent in ``response_format`` or a tool's parameters (``unsupported_schema``),
whether ``tool_choice`` names one of the ``tools`` (``tool_not_found``), whether ``min_tokens`` is
at most ``max_tokens`` (``min_tokens_above_max_tokens``), and whether an image part holds an image that decodes,
within the limits, for a model that takes images (a request holding one may be refused; tests/unit/test_vision.py
checks those refusals one by one), and whether the LoRA admin routes' folder or adapter is there
(tests/e2e/models/test_lora.py checks those). A schema-valid body may answer 400 only with one of those codes.
"""

from __future__ import annotations

from typing import Any

import schemathesis

CODES = ("context_length_exceeded", "unsupported_schema", "tool_not_found", "min_tokens_above_max_tokens")
# Anthropic's error body has no code: the same refusals, told by their messages (neuron/engine/intake.py,
# server/common/submit.py, server/common/tools.py).
MESSAGES = ("but the context holds", "the schema cannot be enforced", "must name one of the tools given")
IMAGE_PARTS = ("image_url", "input_image", "image")  # chat's, the Responses API's and Anthropic's
# They name a folder, an adapter held, or a host (the hosts' routes refuse a group started without --hosts).
ADMIN_ROUTES = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/hosts/add",
    "/v1/hosts/remove",
    "/v1/hosts/drain",
)


def _holds_an_image(value: Any) -> bool:
    if isinstance(value, dict):
        return value.get("type") in IMAGE_PARTS or any(_holds_an_image(v) for v in value.values())
    return isinstance(value, list) and any(_holds_an_image(v) for v in value)


@schemathesis.check
def valid_requests_are_served(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return
    if _holds_an_image(case.body):
        return
    body = response.json()
    error = body.get("error", {})
    if case.path in ADMIN_ROUTES and error.get("param") in ("lora_path", "lora_name"):
        return
    if body.get("type") == "error" and any(m in error.get("message", "") for m in MESSAGES):
        return
    if error.get("code") not in CODES:
        raise AssertionError(f"a schema-valid request was refused: {error.get('message')}")
