"""``GET /v1/models`` and ``/v1/models/{model}``: the one model served, as OpenAI lists models. No MLX."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from neuron.server.common.errors import ApiError
from neuron.server.common.schema import OpenApi, Schema, Spec, get, ref, replies
from neuron.server.http import Call, Endpoint, OrjsonResponse


def _card(call: Call) -> dict[str, Any]:
    return {"id": call.model_id, "object": "model", "created": call.state.started, "owned_by": "neuron"}


async def list_models(call: Call) -> Response:
    return OrjsonResponse({"object": "list", "data": [_card(call)]})


async def get_model(call: Call) -> Response:
    asked = call.request.path_params["model"]
    if asked != call.model_id:
        raise ApiError(404, f"the model `{asked}` does not exist", code="model_not_found")
    return OrjsonResponse(_card(call))


ENDPOINTS = (
    Endpoint("/v1/models", list_models, method="GET"),
    Endpoint("/v1/models/{model:path}", get_model, method="GET"),
)


def openapi(spec: Spec) -> OpenApi:
    model: Schema = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"const": spec.model_id},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    }
    listing = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}},
    }
    paths = {
        "/v1/models": get("the served model", replies(401, ok=ref("ModelList")), **spec.secured),
        "/v1/models/{model}": get(
            "one model",
            replies(401, 404, ok=ref("Model")),
            parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            **spec.secured,
        ),
    }
    return paths, {"Model": model, "ModelList": listing}
