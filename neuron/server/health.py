"""The probes and the scrape, none of which needs a key (probes and scrapers rarely carry one, and these hold
counts, not content): ``/health`` (the process answers), ``/ready`` (the model is loaded and its last probe
passed; otherwise 503 saying why) and ``/metrics`` (Prometheus). No MLX.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from neuron import metrics
from neuron.server.common.errors import not_ready
from neuron.server.common.readiness import not_ready_because
from neuron.server.common.schema import OpenApi, Schema, Spec, get, replies
from neuron.server.http import Call, Endpoint, OrjsonResponse, error_response


async def health(call: Call) -> Response:
    return OrjsonResponse({"status": "ok"})


async def ready(call: Call) -> Response:
    reason = not_ready_because(call.state)
    if reason is not None:
        # Answered, not raised: a poll while loading is no refused request to log.
        error = not_ready(f"not ready: {reason}")
        download = call.state.download
        if call.state.engine is None and download is not None:
            body = {**error.body(), "download": download.snapshot()}
            return OrjsonResponse(body, status_code=error.status, headers=error.headers)
        return error_response(error)
    return OrjsonResponse({"status": "ready", "model": call.model_id})


async def prometheus(call: Call) -> Response:
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


ENDPOINTS = (
    Endpoint("/health", health, method="GET", keyed=False),
    Endpoint("/ready", ready, method="GET", keyed=False),
    Endpoint("/metrics", prometheus, method="GET", keyed=False),
)


def openapi(spec: Spec) -> OpenApi:
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    probe: Schema = {"security": []}
    scraped = {"200": {"description": "OK", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}}
    paths = {
        "/health": get("the process answers", replies(ok=status), **probe),
        "/ready": get("the model is loaded and its last probe passed", replies(503, ok=status), **probe),
        "/metrics": get("Prometheus metrics", scraped, **probe),
    }
    return paths, {}
