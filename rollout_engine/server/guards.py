"""Who may drive the server: the API key every request carries, no web page (Origin), and on a loopback server only
loopback names in Host (no DNS rebinding). ASGI middleware, outside everything else in the app."""
from __future__ import annotations

import hmac
import ipaddress

from .protocol import error_response


class ApiKey:
    """ASGI middleware: every HTTP request carries the bearer key (health and metrics too)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.strip().encode()  # as the token: HTTP carries no surrounding white space

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                          "authentication_error", "invalid_api_key")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


LOOPBACK_NAMES = frozenset({"localhost"})  # with any loopback IP literal, the Host a client of a loopback server sends


def is_loopback_address(address: str) -> bool:
    """`address` (serve's --host) is "localhost" or a loopback IP literal (127.0.0.0/8, ::1): a server bound
    there listens on loopback only."""
    if address in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _is_loopback_host(name: str) -> bool:
    """`name` (a Host header without its port) names a loopback address, an IPv6 literal in brackets (every
    address a loopback server can be told to bind, serve's --host, is one of these), or the unspecified address."""
    # "This host", as clients name a server from the URL vLLM prints: no DNS rebinding sends it (a rebound page
    # sends its own name), and a cross-origin page is refused by its Origin
    if name in ("0.0.0.0", "[::]"):
        return True
    literal = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    if ":" in literal and literal == name:  # an IPv6 literal in a Host header is written in brackets
        return False
    return is_loopback_address(literal)


class BrowserGuard:
    """ASGI middleware: no web page may drive the server. A browser sends a page's cross-origin POST (a JSON body
    labelled text/plain, a form) without asking first, and names the page in `Origin`: such a request is refused
    unless its origin is allowed. A loopback server also takes only a loopback name in `Host`, so a page whose
    name a DNS rebinding points at 127.0.0.1 cannot read its answers either."""

    def __init__(self, app, allowed_origins: frozenset, loopback: bool):
        self.app, self.origins, self.loopback = app, allowed_origins, loopback

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            origin = headers.get(b"origin", b"").decode("latin-1")
            if b"origin" in headers and origin not in self.origins:
                return await error_response(403, f"requests from web pages are refused (Origin: {origin!r}); allow "
                                            "an origin with --allowed-origin", "permission_error")(scope, receive, send)
            host = headers.get(b"host", b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if self.loopback and not _is_loopback_host(name):
                return await error_response(421, f"Host {host!r} is not a loopback name, and this server listens on "
                                            "loopback only", "invalid_request_error")(scope, receive, send)
        return await self.app(scope, receive, send)


def check_api_key(api_key) -> None:
    """None (no authentication) or a non-empty string: an empty key, e.g. from an unset $KEY, would quietly turn
    authentication off."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key must be None (no authentication) or a string that is not all white space; got "
                         f"{api_key!r}")
