"""``GET /v1/models`` and ``/v1/models/{model}``: the model served, as OpenAI lists models, and each LoRA adapter
served beside it as a model of its own, its ``parent`` the base (as vLLM lists them). No MLX."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from neuron.server.common.errors import ApiError
from neuron.server.common.schema import OpenApi, Schema, Spec, get, ref, replies
from neuron.server.http import Call, Endpoint, OrjsonResponse


def _card(call: Call, adapter: str | None = None) -> dict[str, Any]:
    card = {"id": adapter or call.model_id, "object": "model", "created": call.state.started, "owned_by": "neuron"}
    return card | {"parent": call.model_id} if adapter else card


async def list_models(call: Call) -> Response:
    adapters = call.served.adapters
    return OrjsonResponse({"object": "list", "data": [_card(call), *(_card(call, name) for name in adapters)]})


async def get_model(call: Call) -> Response:
    asked = call.request.path_params["model"]
    if asked != call.model_id and asked not in call.served.adapters:
        raise ApiError(404, f"the model `{asked}` does not exist", code="model_not_found")
    return OrjsonResponse(_card(call, None if asked == call.model_id else asked))


ENDPOINTS = (
    Endpoint("/v1/models", list_models, method="GET"),
    Endpoint("/v1/models/{model:path}", get_model, method="GET"),
)


def openapi(spec: Spec) -> OpenApi:
    model: Schema = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string", "description": f"`{spec.model_id}`, or a LoRA adapter's name"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "parent": {"const": spec.model_id, "description": "a LoRA adapter's base model"},
        },
    }
    listing = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}},
    }
    paths = {
        "/v1/models": get("the served model and its LoRA adapters", replies(401, ok=ref("ModelList")), **spec.secured),
        "/v1/models/{model}": get(
            "one model",
            replies(401, 404, ok=ref("Model")),
            parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            **spec.secured,
        ),
    }
    return paths, {"Model": model, "ModelList": listing}
