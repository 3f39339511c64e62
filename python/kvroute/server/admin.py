"""Admin routes: list, add and remove backends while serving (``Authorization: Bearer ADMIN_KEY``).

``POST /admin/backends`` takes ``{"url": ..., "events": ..., "replay": ..., "dp": ..., "name": ...}``
(only ``url`` is required; endpoints not given are derived as for ``--backends``) or
``{"spec": "URL;events=...;..."}``; it answers 201 with the backend. ``DELETE
/admin/backends/NAME`` stops routing to it; requests in flight there finish.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvroute.config import ConfigError, parse_backend
from kvroute.fleet import FleetError
from kvroute.server.errors import ApiError, bad_request
from kvroute.server.schema import decode_json

if TYPE_CHECKING:
    from kvroute.server.app import RouterState

MAX_ADMIN_BODY = 64 * 1024


def check_admin(state: RouterState, request: Request) -> None:
    key = state.config.admin_key
    if key is None:
        raise ApiError(403, "the admin API is disabled (start the router with --admin-key)")
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "invalid or missing admin key", headers={"www-authenticate": "Bearer"})


def _describe(state: RouterState, name: str) -> dict[str, Any]:
    for b in state.fleet.snapshot():
        if b["name"] == name:
            return b
    raise ApiError(404, f"no backend named {name!r}")


async def list_backends(state: RouterState, request: Request) -> Response:
    check_admin(state, request)
    return JSONResponse({"backends": state.fleet.snapshot()})


async def add_backend(state: RouterState, request: Request) -> Response:
    check_admin(state, request)
    raw = await request.body()
    if len(raw) > MAX_ADMIN_BODY:
        raise ApiError(413, "the request body is too large")
    body = decode_json(raw)
    entry: Any = body.get("spec") if "spec" in body else body
    if not isinstance(entry, str | dict):
        raise bad_request("expected a backend table or {'spec': 'URL;key=value...'}")
    try:
        spec = parse_backend(state.config, entry)
        backend = await state.fleet.add(spec)
    except ConfigError as e:
        raise bad_request(str(e)) from None
    except FleetError as e:
        raise ApiError(409, str(e)) from None
    return JSONResponse(_describe(state, backend.name), status_code=201)


async def remove_backend(state: RouterState, request: Request) -> Response:
    check_admin(state, request)
    name = request.path_params["name"]
    try:
        dropped = await state.fleet.remove(name)
    except FleetError as e:
        raise ApiError(404, str(e)) from None
    return JSONResponse({"removed": name, "dropped_reservations": dropped})
