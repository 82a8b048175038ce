"""Who may talk to the server: the Host it is addressed as, and the API key.

Both are pure ASGI middleware, so streaming responses pass straight through.

- ``AllowedHosts``: a server on 127.0.0.1 with no key is reachable from any
  web page the user opens, through DNS rebinding (the page's own domain made
  to resolve to 127.0.0.1; CVE-2024-28224 is this bug in another server).
  The browser still sends the page's domain as ``Host``, so answering only
  the names this server is meant to be reached by closes it.
- ``RequireApiKey``: one or more keys; each request's key (or none) becomes
  its cache scope, so prefixes cached for one key are never reused, or timed,
  by another. ``/health`` stays open, with details only for a valid key.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from .errors import ApiError, json_error


class AllowedHosts:
    """Answers only requests whose ``Host`` (port aside) is one of ``hosts``;
    ``hosts=None`` answers any."""

    def __init__(self, app, hosts: frozenset[str] | None):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send) -> None:
        if self.hosts is None or scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"host")
        if given is None or host_name(given.decode("latin-1")) in self.hosts:
            return await self.app(scope, receive, send)
        shown = given.decode("latin-1")[:100]
        message = (f"this server does not answer to the host {shown!r}; it answers to "
                   f"{', '.join(sorted(self.hosts))} (start it with --allowed-host {host_name(shown) or 'NAME'} "
                   f"to add a name)")
        await json_error(ApiError(400, message, code="host_not_allowed"))(scope, receive, send)


def host_name(header: str) -> str:
    """``"127.0.0.1:8080"`` -> ``"127.0.0.1"``, ``"[::1]:8080"`` -> ``"::1"``, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequireApiKey:
    """Every route but ``/health`` needs ``Authorization: Bearer KEY`` (or
    Anthropic's ``x-api-key: KEY``) for one of ``keys`` (none configured: open). Sets ``authenticated`` and
    ``cache_scope`` in the request's state."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app = app
        self.keys = [(f"Bearer {key}".encode(), _scope_of(key)) for key in keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        if not self.keys:
            state.update(authenticated=True, cache_scope="")
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if not given and b"x-api-key" in headers:  # Anthropic's clients send the key bare, in x-api-key
            given = b"Bearer " + headers[b"x-api-key"]
        matched = None
        for expected, key_scope in self.keys:  # every key compared, in constant time
            if hmac.compare_digest(given, expected):
                matched = key_scope
        state.update(authenticated=matched is not None, cache_scope=matched or "")
        if matched is not None or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        message = ("this server needs an API key: send 'Authorization: Bearer KEY'" if not given
                   else "the API key is wrong; send a key the server was started with")
        await json_error(ApiError(401, message, "invalid_request_error", "invalid_api_key"))(scope, receive, send)


def _scope_of(key: str) -> str:
    """A key's cache scope: a digest, so the engine never sees the key itself."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def authenticated(request: Request) -> bool:
    return bool(request.scope.get("state", {}).get("authenticated"))


def cache_scope(request: Request) -> str:
    return request.scope.get("state", {}).get("cache_scope", "")
