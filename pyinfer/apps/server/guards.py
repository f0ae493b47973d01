"""What every request of `pyinfer serve` must pass before a handler sees it, against the web pages a user
visits (issue 31): the Host check (DNS rebinding), JSON-only bodies (cross-site "simple" requests), and the
page's own headers. The server's routes call them; CORS, when allowed, is Starlette's middleware."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re

from starlette.requests import Request

from pyinfer.apps.server.openai_errors import ApiError

# the page: never framed, no sniffing, no referrer (its Content-Security-Policy is page_policy's)
PAGE_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-cache"}


def check_host(request: Request, allowed: frozenset[str]) -> None:
    """DNS rebinding: a page whose own domain resolves to this machine sends its domain as Host. Only IP
    literals, localhost and the names the user allowed (--host, --allowed-host; "*": any) are this server's."""
    header = request.headers.get("host")
    if header is None:
        raise ApiError(400, "the request has no Host header", code="invalid_host")
    name = _host_name(header)
    if "*" in allowed or name == "localhost" or name.endswith(".localhost") or name in allowed or _is_ip(name):
        return
    raise ApiError(403, f"this server does not answer for the host '{name}': ask for it by its address or allow "
                        "the name with --allowed-host", code="invalid_host")


def page_policy(page: str) -> str:
    """The page's Content-Security-Policy: nothing from elsewhere, its inline style and script by their hashes."""
    def hashes(tag: str) -> str:
        bodies = re.findall(f"<{tag}>(.*?)</{tag}>", page, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _host_name(header: str) -> str:
    """The lower-case name or address of a Host header, without its port ('[::1]:8080' -> '::1')."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_json(request: Request) -> None:
    """Cross-site requests: a page may send another site a 'simple' POST (text/plain, no preflight); a body
    only counts as JSON when it says so, which a browser lets a foreign page do only after a CORS preflight."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the request body must be sent as 'Content-Type: application/json', not "
                            f"'{media or 'none'}'", code="unsupported_media_type")
