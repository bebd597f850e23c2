"""``GET /`` and its files under ``/page/``: the chat playground and the cluster view, static files shipped in the
wheel (no build step, no CDN: a cluster with no internet serves it whole). No MLX.

The files hold no key and no content, and sit behind the API key where one is set, as every API route does (after
the same Origin and Host checks): without it they answer 401 with a Basic challenge, so the browser asks for the key
(any user name, the key as the password) and resends it with the page's own calls, which take it as any route does.
Should those calls still be refused, the page asks for the key itself and sends it as a bearer token, kept in the
tab's session storage, never in the page. Every reply carries a Content-Security-Policy
that allows scripts, styles and connections from this server only, and no inline script or style, so that text
a model writes cannot run as code even if the page ever put it in as HTML.
"""

from __future__ import annotations

from importlib import resources

from starlette.responses import Response

from neuron.server.common.errors import ApiError
from neuron.server.common.schema import OpenApi, Spec
from neuron.server.http import Call, Endpoint

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
STATIC = resources.files(__package__) / "static"
FILES = {item.name: item.read_bytes() for item in STATIC.iterdir() if item.name.endswith(tuple(TYPES))}


def _file(name: str) -> Response:
    if name not in FILES:
        raise ApiError(404, f"the page has no file {name!r}; open / for the page", code="not_found")
    return Response(FILES[name], media_type=TYPES["." + name.rsplit(".", 1)[1]], headers=HEADERS)


async def index(call: Call) -> Response:
    return _file("index.html")


async def asset(call: Call) -> Response:
    return _file(call.request.path_params["name"])


# Basic, not Bearer: the browser itself asks for the key (any user name, the key as the password) and resends it
# with the page's files and the page's own calls, so no script ever holds it.
CHALLENGE = 'Basic realm="neuron"'
ENDPOINTS = (
    Endpoint("/", index, method="GET", challenge=CHALLENGE),
    Endpoint("/page/{name}", asset, method="GET", challenge=CHALLENGE),
)


def openapi(spec: Spec) -> OpenApi:
    """The page is for browsers, not clients: it is left out of the API's document."""
    return {}, {}
