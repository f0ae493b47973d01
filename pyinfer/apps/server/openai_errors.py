"""Every failure the server answers is OpenAI's error object, `{"error": {message, type, param, code}}`, with
one clear line as its message: a client's mistake is a 4xx that says what to change, never a 500."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from pyinfer.console import one_line
from pyinfer.engine.completions import GenerationStopped
from pyinfer.errors import ContextFullError, InvalidArgumentError, PyInferError
from pyinfer.formats.chat_template import ChatTemplateError

# llama-server's error types, which its clients already know
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "unavailable_error"}


class ApiError(Exception):
    """An HTTP error answer; raised anywhere in a request's handling."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_exception(exc: BaseException) -> ApiError:
    """The answer to an exception raised while handling a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextFullError):
        return ApiError(400, one_line(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, InvalidArgumentError | ChatTemplateError):
        return ApiError(400, one_line(exc))
    if isinstance(exc, GenerationStopped):
        return ApiError(503, f"the server is shutting down: {one_line(exc)}", code="shutting_down")
    if isinstance(exc, PyInferError):
        return ApiError(500, one_line(exc))
    return ApiError(500, f"internal error: {type(exc).__name__}: {one_line(exc)}")


def from_validation(exc: ValidationError) -> ApiError:
    """A 400 naming the first wrong field of a request body, with what was wrong about it."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = str(first.get("ctx", {}).get("error", first["msg"]))
        if "surrogate" in reason or "hex escape" in reason:  # the parser's words for these are misleading
            where = reason[reason.find(" at line"):] if " at line" in reason else ""
            return ApiError(400, f"the request body holds a broken \\u escape{where}: a UTF-16 surrogate "
                                 "(\\ud800-\\udfff) without its other half, or fewer than four hex digits; "
                                 "send valid Unicode text")
        return ApiError(400, f"the request body is not valid JSON: {reason}")
    if not first["loc"]:
        return ApiError(400, f"the request body must be a JSON object: {first['msg']}")
    param = str(first["loc"][0])  # deeper parts name union branches ("str", "list[str]"), not places
    got = repr(first["input"])
    got = got if len(got) <= 40 else got[:37] + "..."
    others = {e["loc"][0] for e in errors if e["loc"]} - {first["loc"][0]}
    more = f" (and {len(others)} more fields)" if others else ""
    return ApiError(400, f"invalid '{param}': {first['msg']}, got {got}{more}", param=param)
