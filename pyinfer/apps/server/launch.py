"""Starts `pyinfer serve`: loads the model, binds the address (a port in use is one line, before anything
runs), and runs uvicorn until SIGINT or SIGTERM, which end the token in flight and exit 0."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path

from pyinfer.apps.flags import load_model, sampler_params
from pyinfer.apps.server.app import Server, Settings
from pyinfer.apps.server.engine import Engine
from pyinfer.apps.server.http_protocol import protocol
from pyinfer.errors import PyInferError
from pyinfer.formats.chat_template import ChatTemplate

API_KEY_VARIABLE = "PYINFER_API_KEY"
GRACEFUL_SHUTDOWN_S = 10  # uvicorn's wait for open connections after a stop signal


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        raise PyInferError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _uvicorn_server(config, engine: Engine):
    import uvicorn

    class StoppingServer(uvicorn.Server):
        """uvicorn, but a stop signal first tells the engine to end the generation in flight at its next token
        (uvicorn then waits for the open responses, which end promptly)."""

        def handle_exit(self, sig, frame) -> None:
            engine.stop()
            super().handle_exit(sig, frame)

    return StoppingServer(config)


def serve(args) -> int:
    import uvicorn

    if args.queue < 0 or min(args.max_body, args.body_timeout, args.head_timeout) <= 0:
        raise PyInferError("--queue must be >= 0, --max-body, --body-timeout and --head-timeout > 0")
    api_key = _api_key(args)  # a bad key file fails before the model loads
    path, model = load_model(args)
    template = ChatTemplate.from_tokenizer(model.tokenizer, override=args.chat_template_file)
    file = Path(path)
    settings = Settings(model_name=args.alias or file.stem, model_aliases=frozenset({file.stem, file.name}),
                        api_key=api_key, max_body=args.max_body << 20, queue=args.queue,
                        sampling=sampler_params(args), max_tokens=args.n_predict if args.n_predict > 0 else None,
                        seed=args.seed, allowed_hosts=frozenset(h.lower() for h in [args.host, *args.allowed_host]),
                        cors_origins=tuple(args.cors_origin), content_control_tokens=args.content_control_tokens,
                        body_timeout_s=args.body_timeout)
    sock = _listen(args.host, args.port)
    server = Server(model, template, settings)
    # no lifespan: a second Ctrl-C makes uvicorn cancel it, and Starlette logs that as a traceback
    config = uvicorn.Config(server.app(), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, http=protocol(args.head_timeout))
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    cfg = model.config
    print(f"pyinfer serve: {file.name} ({cfg.arch}, {cfg.n_layer} layers) loaded in {model.timings.load_ms:.0f} ms; "
          f"context {model.n_ctx} tokens, model name '{settings.model_name}', queue {settings.queue}",
          file=sys.stderr)
    if settings.api_key is None and not _is_loopback(host):
        print(f"warning: {host} is reachable from other machines and there is no --api-key", file=sys.stderr)
    print(f"listening on {url} (chat page at {url}/, OpenAI API at {url}/v1); Ctrl-C stops", file=sys.stderr,
          flush=True)
    _log_requests()
    # uvicorn re-raises a stop signal, once it has shut down, to the handler it found at start: this one
    # ignores it, so a requested stop is a clean exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        _uvicorn_server(config, server.engine).run(sockets=[sock])
    finally:
        server.engine.close()
    print("pyinfer serve: stopped", file=sys.stderr)
    return 0


def _api_key(args) -> str | None:
    """--api-key, else the first line of --api-key-file, else $PYINFER_API_KEY (the last two stay out of `ps`)."""
    if args.api_key and args.api_key_file:
        raise PyInferError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise PyInferError(f"cannot read --api-key-file {args.api_key_file}: {exc}") from None
        if not lines or not lines[0].strip():
            raise PyInferError(f"--api-key-file {args.api_key_file} is empty")
        return lines[0].strip()
    return args.api_key or os.environ.get(API_KEY_VARIABLE) or None


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _log_requests() -> None:
    """One line per completion on stderr, as llama-server logs its slots."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    log = logging.getLogger("pyinfer.apps.server")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
