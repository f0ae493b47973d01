"""The routes of `pyinfer serve`: OpenAI's /v1/models, /v1/chat/completions and /v1/completions, llama-server's
/health, /tokenize, /detokenize and /metrics, and the chat page at /. Handlers run on the event loop; the model
is touched only by the engine's thread (generation) and, under a lock, by tokenization in the thread pool."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
from dataclasses import dataclass
from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from pyinfer.apps.server.engine import Engine, Job
from pyinfer.apps.server.guards import PAGE_HEADERS, check_host, check_json, page_policy
from pyinfer.apps.server.metrics import Metrics
from pyinfer.apps.server.openai_errors import ApiError, from_exception
from pyinfer.apps.server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pyinfer.console import one_line
from pyinfer.engine.completions import CHAT, TEXT, Generation, chat_messages, chunks, response, text_prompt_tokens
from pyinfer.engine.sampling import SamplerParams
from pyinfer.errors import ContextFullError
from pyinfer.formats.chat_template import ChatTemplate

log = logging.getLogger("pyinfer.apps.server")

SHUTDOWN_GRACE_S = 5  # a stream's last event after a stop signal; uvicorn's own limit is longer
DISCARD_LIMIT = 64 << 20  # an oversized body is read (and dropped) this far, so the client can read the 413


@dataclass(frozen=True)
class Settings:
    model_name: str  # what /v1/models lists
    model_aliases: frozenset[str]  # further names requests may use
    api_key: str | None
    max_body: int  # bytes
    queue: int  # requests that may wait behind the running one
    sampling: SamplerParams  # for fields a request leaves out
    max_tokens: int | None
    seed: int | None
    allowed_hosts: frozenset[str] = frozenset()  # Host names besides IP literals and localhost; "*": any
    cors_origins: tuple[str, ...] = ()  # web origins whose pages may call the API (none: the browser's rule)
    content_control_tokens: bool = False  # messages may spell control tokens (ChatTemplate.encode)
    body_timeout_s: float = 30.0  # the longest pause inside a request body


class Server:
    def __init__(self, model, template: ChatTemplate, settings: Settings) -> None:
        self.model = model
        self.template = template
        self.settings = settings
        self.engine = Engine(settings.queue)
        self.metrics = Metrics(self.engine, settings.model_name, model.n_ctx)
        self._tokenizer_lock = threading.Lock()  # Tokenizer.encode is not thread-safe
        self._page = resources.files("pyinfer.apps.server").joinpath("static/index.html").read_bytes()
        self._page_headers = {**PAGE_HEADERS, "Content-Security-Policy": page_policy(self._page.decode())}

    def app(self) -> Starlette:
        routes = [
            self._route("/", self.page, "GET", public=True),
            self._route("/health", self.health, "GET", public=True),
            self._route("/v1/models", self.models, "GET"),
            self._route("/v1/models/{model_id:path}", self.model_card, "GET"),
            self._route("/v1/chat/completions", self.chat_completions, "POST"),
            self._route("/v1/completions", self.completions, "POST"),
            self._route("/tokenize", self.tokenize, "POST"),
            self._route("/detokenize", self.detokenize, "POST"),
            self._route("/metrics", self.metrics_text, "GET"),
        ]
        cors = self.settings.cors_origins
        middleware = [Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
                                 allow_headers=["Authorization", "Content-Type"])] if cors else []
        return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: self._http_error})

    def _route(self, path: str, handler, method: str, public: bool = False) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                check_host(request, self.settings.allowed_hosts)
                if not public:
                    self._authorize(request)
                if method == "POST":
                    check_json(request)
                answer = await handler(request)
            except Exception as exc:  # every failure is an error object; the server goes on
                answer = _logged(exc, request).response()
            self.metrics.requests.labels(path, str(answer.status_code)).inc()
            return answer

        return Route(path, endpoint, methods=[method])

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        """Unknown paths and wrong methods, as error objects."""
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method} (allowed: {exc.headers.get('Allow', '')})"
        else:
            message = exc.detail
        self.metrics.requests.labels("unmatched", str(exc.status_code)).inc()
        return ApiError(exc.status_code, message, headers=exc.headers).response()

    # ---- checks every request passes ----

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "invalid API key", code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_body
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + DISCARD_LIMIT:  # not worth waiting for: answer now
            raise _too_large(limit, {"Connection": "close"})
        over = declared.isdigit() and int(declared) > limit
        body, seen = bytearray(), 0
        chunks = request.stream().__aiter__()
        while True:
            try:  # a stalled upload must not hold a connection forever
                chunk = await asyncio.wait_for(chunks.__anext__(), self.settings.body_timeout_s)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise ApiError(408, f"the request body stalled for {self.settings.body_timeout_s:g} s (--body-timeout)",
                               code="request_timeout", headers={"Connection": "close"}) from None
            except ClientDisconnect:
                raise ApiError(499, "the client went away during the upload", code="client_closed") from None
            seen += len(chunk)
            over = over or seen > limit
            if not over:
                body += chunk
            elif seen > limit + DISCARD_LIMIT:
                break
        if over:
            raise _too_large(limit)
        return bytes(body)

    def _check_model(self, name: str | None) -> None:
        if name and name != self.settings.model_name and name not in self.settings.model_aliases:
            raise ApiError(404, f"the model '{name}' does not exist; this server runs '{self.settings.model_name}'",
                           param="model", code="model_not_found")

    async def _encode(self, tokens_of):
        """Runs tokens_of() (chat template, tokenizer) in the thread pool, one at a time."""
        def locked():
            with self._tokenizer_lock:
                return tokens_of()

        return await run_in_threadpool(locked)

    # ---- endpoints ----

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self._page, headers=self._page_headers)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def _card(self) -> dict:
        cfg = self.model.config
        meta = {"arch": cfg.arch, "n_layer": cfg.n_layer, "n_vocab": cfg.n_vocab, "n_ctx": self.model.n_ctx,
                "n_ctx_train": cfg.n_ctx_train}
        return {"id": self.settings.model_name, "object": "model", "owned_by": "pyinfer",
                "created": int(os.path.getmtime(self.model.file.path)), "meta": meta}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request) -> Response:
        self._check_model(request.path_params["model_id"])
        return JSONResponse(self._card())

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        body = TokenizeRequest.parse(await self._body(request))
        ids = await self._encode(lambda: self.model.tokenize(body.content, add_special=body.add_special))
        if body.with_pieces:
            piece = self.model.tokenizer.token_to_piece
            return JSONResponse({"tokens": [{"id": i, "piece": piece(i)} for i in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = DetokenizeRequest.parse(await self._body(request))
        n_vocab = self.model.config.n_vocab
        if not all(0 <= t < n_vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {n_vocab})", param="tokens")
        return JSONResponse({"content": self.model.detokenize(body.tokens)})

    async def chat_completions(self, request: Request) -> Response:
        body = ChatCompletionRequest.parse(await self._body(request))
        messages = chat_messages(body.messages)
        special = self.settings.content_control_tokens
        return await self._complete(request, body, CHAT,
                                    lambda: self.template.encode(self.model.tokenizer, messages, special))

    async def completions(self, request: Request) -> Response:
        body = CompletionRequest.parse(await self._body(request))
        prompt = body.single_prompt
        return await self._complete(request, body, TEXT, lambda: text_prompt_tokens(self.model, prompt))

    # ---- running a completion ----

    async def _complete(self, request: Request, body, kind, tokens_of) -> Response:
        """Checks and queues one completion; streams its chunks or answers its response."""
        self._check_model(body.model)
        options = body.options(self.settings.max_tokens, self.settings.seed)
        try:
            gen = Generation(self.model, await self._encode(tokens_of), options, self.settings.sampling)
        except ContextFullError as exc:  # the field that made the prompt too long
            raise ApiError(400, one_line(exc), param="messages" if kind is CHAT else "prompt",
                           code="context_length_exceeded") from None
        job = Job(self._work(gen, kind, bool(body.stream), body.include_usage))
        self.engine.submit(job)
        if body.stream:
            return EventSourceResponse(self._events(job, request), sep="\n", shutdown_grace_period=SHUTDOWN_GRACE_S)
        watcher = asyncio.create_task(self._cancel_on_disconnect(request, job))
        try:
            (answer,) = [item async for item in job.results()]
        except Exception:
            if job.cancelled.is_set():  # nobody reads this answer; nginx's code, for the metrics
                raise ApiError(499, "the client closed the request before the answer") from None
            raise
        finally:
            watcher.cancel()
        return JSONResponse(answer)

    def _work(self, gen: Generation, kind, stream: bool, include_usage: bool):
        name = self.settings.model_name

        def work(job: Job) -> None:  # on the engine thread
            gen.should_stop = job.should_stop
            waited = job.started - job.arrived
            try:
                if stream:
                    for chunk in chunks(gen, kind, name, include_usage):
                        job.emit(chunk)
                else:
                    job.emit(response(gen, kind, name))
            finally:
                self.metrics.record(gen.usage, waited, job.cancelled.is_set())
                log.info("%s", _summary(kind.object, gen, waited, job.cancelled.is_set()))

        return work

    async def _events(self, job: Job, request: Request):
        """The SSE events of a streamed completion: its chunks, then [DONE]; an error after the 200 went out is
        one more event (OpenAI's clients raise it). ASCII JSON: no character a line-splitting client could take
        for a line end."""
        try:
            async for chunk in job.results():
                yield {"data": json.dumps(chunk)}
            yield {"data": "[DONE]"}
        except Exception as exc:
            yield {"data": json.dumps(_logged(exc, request).body())}
        finally:
            job.cancel()  # when the client went away, the generation stops at its next token

    @staticmethod
    async def _cancel_on_disconnect(request: Request, job: Job) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()


def _too_large(limit: int, headers: dict | None = None) -> ApiError:
    return ApiError(413, f"the request body is larger than the limit of {limit} bytes (--max-body)",
                    code="request_too_large", headers=headers)


def _logged(exc: BaseException, request: Request) -> ApiError:
    """The error answer to exc; the server's own failures (5xx) also go to the log."""
    error = from_exception(exc)
    if error.status >= 500:
        log.error("%s %s: %s", request.method, request.url.path, error.message)
    return error


def _summary(what: str, gen: Generation, waited_s: float, cancelled: bool) -> str:
    u = gen.usage
    end = "cancelled by the client" if cancelled else gen.finish_reason or "stopped"
    return (f"{what}: waited {1e3 * waited_s:.0f} ms | prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached) in "
            f"{u.prompt_ms:.0f} ms | {u.completion_tokens} tokens in {u.generation_ms:.0f} ms, "
            f"{u.tokens_per_second:.1f} t/s | {end}")
