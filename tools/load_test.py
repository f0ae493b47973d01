"""A bounded load test of `pyinfer serve` on loopback: starts the server on a free 127.0.0.1 port, runs CLIENTS
threads x REQUESTS streamed chat completions each through the official openai client, stops the server, and
reports p50/p95 time to first token and to last token, tokens/s and failures (docs/BENCHMARKS.md). Needs the
`openai` package (the test extra).

    python -m tools.load_test -m MODEL --clients 4 --requests 25 --max-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyinfer.console import run_cli
from pyinfer.errors import PyInferError

START_TIMEOUT_S = 120
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Name three primary colours.",
    "How do bees make honey?", "What is the boiling point of water?", "Write a haiku about autumn.",
    "Explain photosynthesis in one paragraph.", "What is a prime number?", "Give me a tip for learning to cook.",
    "Who wrote Romeo and Juliet?", "What causes the seasons?", "Describe a cat to someone who never saw one.",
    "How many continents are there?", "What is the largest ocean?", "Suggest a name for a pet turtle.",
    "Why do leaves change colour in autumn?", "What does a compiler do?", "How far away is the moon?",
    "What is the difference between weather and climate?", "Tell me a fun fact about octopuses.",
    "How do airplanes stay in the air?", "What is the speed of light?", "Recommend a board game for four people.",
    "What is the tallest mountain on Earth?", "How does a rainbow form?",
]


@contextlib.contextmanager
def serve_in_background(model: str | os.PathLike[str] | None, log_path: Path, *flags: str):
    """Runs `pyinfer serve [-m MODEL] --port 0 FLAGS` as a child until the block ends; yields (process, url)."""
    args = [sys.executable, "-m", "pyinfer", "serve", *(["-m", str(model)] if model else []), "--port", "0",
            *flags]
    with open(log_path, "w") as log:
        # a suite or shell that runs us in the background leaves SIGINT ignored; the server needs it back
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (found := re.search(r"listening on (http://\S+)", log_path.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise PyInferError(f"pyinfer serve did not start: {tail[0]}")
            time.sleep(0.05)
        yield proc, found.group(1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class Outcome:
    ok: bool
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    tokens: int = 0
    error: str = ""


def one_request(client, model: str, question: str, max_tokens: int, temperature: float, seed: int) -> Outcome:
    t0 = time.perf_counter()
    first, usage, finish = None, None, None
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
            temperature=temperature, seed=seed, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage
    except Exception as exc:  # any failure counts, whatever the client raised
        return Outcome(False, error=f"{type(exc).__name__}: {exc}")
    last = time.perf_counter() - t0
    if usage is None or finish not in ("stop", "length"):
        return Outcome(False, error=f"incomplete stream (finish_reason {finish}, usage {usage})")
    return Outcome(True, first if first is not None else last, last, usage.completion_tokens)


def run_load(url: str, n_clients: int, n_requests: int, max_tokens: int, temperature: float,
             timeout_s: float) -> tuple[list[Outcome], float]:
    """(outcomes, wall seconds) of n_clients threads sending n_requests requests each, one after another."""
    from openai import OpenAI

    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        client = OpenAI(base_url=f"{url}/v1", api_key="sk-no-key", max_retries=0, timeout=timeout_s)
        name = client.models.list().data[0].id
        for j in range(n_requests):
            k = i + j * n_clients
            out = one_request(client, name, QUESTIONS[k % len(QUESTIONS)], max_tokens, temperature, seed=k)
            with lock:
                outcomes.append(out)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.perf_counter() - t0


def summary(outcomes: list[Outcome], wall_s: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    first = np.array([o.first_token_s for o in ok]) if ok else np.zeros(1)
    last = np.array([o.last_token_s for o in ok]) if ok else np.zeros(1)
    decode = [(o.tokens - 1) / (o.last_token_s - o.first_token_s) for o in ok
              if o.tokens > 1 and o.last_token_s > o.first_token_s]
    tokens = sum(o.tokens for o in ok)
    return {"requests": len(outcomes), "ok": len(ok), "failed": len(outcomes) - len(ok),
            "errors": sorted({o.error for o in outcomes if not o.ok}), "wall_s": round(wall_s, 2),
            "first_token_p50_s": round(float(np.percentile(first, 50)), 3),
            "first_token_p95_s": round(float(np.percentile(first, 95)), 3),
            "last_token_p50_s": round(float(np.percentile(last, 50)), 3),
            "last_token_p95_s": round(float(np.percentile(last, 95)), 3),
            "tokens": tokens, "tokens_per_second": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
            "request_decode_tokens_per_second_p50": round(float(np.median(decode)), 2) if decode else 0.0}


def report(s: dict, args) -> str:
    lines = [
        f"load test {s['started']}: {args.clients} clients x {args.requests} streamed chat requests, max_tokens "
        f"{args.max_tokens}, temperature {args.temp}; {platform.machine()} with {os.cpu_count()} CPUs, load "
        f"{s['load_before']:.1f} before, {os.getloadavg()[0]:.1f} after",
        f"requests: {s['ok']} ok, {s['failed']} failed in {s['wall_s']:.1f} s",
        f"time to first token: p50 {s['first_token_p50_s']:.2f} s, p95 {s['first_token_p95_s']:.2f} s "
        f"(queue wait included)",
        f"time to last token:  p50 {s['last_token_p50_s']:.2f} s, p95 {s['last_token_p95_s']:.2f} s",
        f"tokens: {s['tokens']} generated, {s['tokens_per_second']:.1f} tokens/s overall; one request decodes at "
        f"{s['request_decode_tokens_per_second_p50']:.1f} tokens/s (p50)",
        *[f"error: {e}" for e in s["errors"]],
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.load_test", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="model for pyinfer serve (default: the default model)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--requests", type=int, default=25, help="requests per client, one after another (default 25)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--temp", type=float, default=0.7, help="temperature (default 0.7; each request its own seed)")
    p.add_argument("-t", "--threads", type=int, default=None, help="the server's CPU threads (default: serve's)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="the server's context size (default 2048)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one request may take (default 300)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def _body(args) -> int:
    if min(args.clients, args.requests, args.max_tokens) < 1:
        raise PyInferError("--clients, --requests and --max-tokens must be at least 1")
    flags = ["-c", str(args.ctx_size), "--queue", str(args.clients)]
    flags += ["-t", str(args.threads)] if args.threads else []
    with tempfile.TemporaryDirectory() as tmp, serve_in_background(args.model, Path(tmp) / "serve.log", *flags) as (
            _, url):
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        load_before = os.getloadavg()[0]  # the machine's other work, which these numbers share it with
        outcomes, wall_s = run_load(url, args.clients, args.requests, args.max_tokens, args.temp, args.timeout)
    s = {"started": started, "load_before": load_before, **summary(outcomes, wall_s)}
    print(json.dumps(s, indent=1) if args.json else report(s, args))
    return 0 if s["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    return run_cli("load_test", build_parser(), _body, argv)


if __name__ == "__main__":
    sys.exit(main())
