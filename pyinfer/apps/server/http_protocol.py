"""uvicorn's h11 protocol with the server's manners: a malformed request gets OpenAI's error object (uvicorn
answers plain text), and a request head that has not arrived within the head timeout gets 408 and the
connection closes (a client trickling headers, or never finishing them, would otherwise hold it forever)."""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

REASONS = {400: b"Bad Request", 408: b"Request Timeout"}


def protocol(head_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this head timeout."""

    class Protocol(_Protocol):
        timeout_head = head_timeout_s

    return Protocol


class _Protocol(H11Protocol):
    timeout_head: float

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._last_cycle:  # the head arrived
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()  # the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._answer(400, f"malformed HTTP request: {msg}", "invalid_http")

    def _await_head(self) -> None:
        self._cancel_head_timer()
        self._last_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.timeout_head, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
        self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is self._last_cycle and not self.transport.is_closing():
            self._answer(408, f"the request head did not arrive within {self.timeout_head:g} s (--head-timeout)",
                         "request_timeout")

    def _answer(self, status: int, message: str, code: str) -> None:
        """The error object, written as raw bytes (h11 refuses a response to a request it has not seen whole),
        then the connection closes."""
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n" % (status, REASONS[status], len(body)) + body)
        self.transport.close()
