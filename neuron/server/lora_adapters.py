"""vLLM's admin routes for LoRA adapters while serving: ``POST /v1/load_lora_adapter`` (``lora_name``,
``lora_path``: a folder in mlx-lm's or PEFT's format, or a Hub name) and ``POST /v1/unload_lora_adapter``
(``lora_name``). They are admin routes (``http.authorize_admin``): behind the API key, and with no key set,
open to loopback clients only. A loaded adapter is a model of its own in
``/v1/models`` at once; a bad one is refused with a 400 that says why, and nothing changes. No MLX.
"""

from __future__ import annotations

from starlette.responses import PlainTextResponse, Response

from neuron.engine.refusals import Unavailable
from neuron.models.adapters import AdapterError
from neuron.server.common.errors import refused
from neuron.server.common.fields import an_object, bad, known
from neuron.server.common.schema import OpenApi, Spec, admin_post, replies
from neuron.server.http import Call, Endpoint


def _text(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip():
        raise bad(name, f"`{name}` is required, a non-empty string", "missing_required_parameter")
    return value.strip()


async def load_lora_adapter(call: Call) -> Response:
    body = an_object(call.body)
    known(body, frozenset({"lora_name", "lora_path", "load_inplace"}))
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    if name == call.model_id:
        raise bad("lora_name", f"the base model is served as `{name}`; give the adapter another name")
    engine = call.engine
    try:
        await engine.adapters.load(name, path)
    except AdapterError as e:
        raise bad("lora_path", str(e)) from None
    except Unavailable as e:
        raise refused(e) from e
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(call: Call) -> Response:
    body = an_object(call.body)
    known(body, frozenset({"lora_name", "lora_int_id"}))
    name = _text(body, "lora_name")
    try:
        await call.engine.adapters.unload(name)
    except AdapterError as e:
        raise bad("lora_name", str(e)) from None
    except Unavailable as e:
        raise refused(e) from e
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


ENDPOINTS = (
    Endpoint("/v1/load_lora_adapter", load_lora_adapter, strict_json=True, admin=True),
    Endpoint("/v1/unload_lora_adapter", unload_lora_adapter, strict_json=True, admin=True),
)


def openapi(spec: Spec) -> OpenApi:
    name = {"type": "string", "minLength": 1, "description": "the adapter's name: requests send it as `model`"}
    load = {
        "type": "object",
        "required": ["lora_name", "lora_path"],
        "properties": {
            "lora_name": name,
            "lora_path": {
                "type": "string",
                "minLength": 1,
                "description": "a folder holding adapter_config.json and adapters.safetensors (mlx-lm's) or "
                "adapter_model.safetensors (PEFT's), or a Hub name",
            },
            "load_inplace": {"type": "boolean"},
        },
        "additionalProperties": False,
    }
    unload = {
        "type": "object",
        "required": ["lora_name"],
        "properties": {"lora_name": name, "lora_int_id": {"type": "integer"}},
        "additionalProperties": False,
    }
    done = {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    errors = replies(400, 401, 403, 413, 415, 500, 503)
    return {
        "/v1/load_lora_adapter": admin_post(spec, "serve a LoRA adapter as a model of its own", load, done | errors),
        "/v1/unload_lora_adapter": admin_post(spec, "stop serving a LoRA adapter", unload, done | errors),
    }, {}
