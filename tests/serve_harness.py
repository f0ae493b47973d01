"""A live `pyinfer serve` in a child process on 127.0.0.1 (a free port), raw HTTP requests, and the official
openai client pointed at it. Shared by the server, page and load-test tests."""
from __future__ import annotations

import contextlib
import http.client
import json
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tools.load_test import serve_in_background

REPO = Path(__file__).resolve().parents[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log_path: Path
    api_key: str | None = None  # what /metrics needs, when the server wants a key

    @property
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def client(self, api_key: str = "sk-no-key", **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def connection(self, timeout: float = 120) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | dict | list | None = None,
                headers: dict | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
        """(status, headers, body) of one request; dict and list bodies are sent as JSON (and say so)."""
        headers = dict(headers or {})
        if isinstance(body, dict | list):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
        conn = self.connection()
        try:
            conn.request(method, path, body=body, headers=headers)
            res = conn.getresponse()
            return res.status, res.headers, res.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
        status, _, data = self.request(method, path, body, headers)
        return status, json.loads(data)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its name with labels, through Prometheus' own parser."""
        from prometheus_client.parser import text_string_to_metric_families

        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        status, _, data = self.request("GET", "/metrics", headers=auth)
        assert status == 200, data
        out = {}
        for family in text_string_to_metric_families(data.decode()):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@contextlib.contextmanager
def live_server(model: Path | str, log_dir: Path, *flags: str):
    """Runs `pyinfer serve -m MODEL --port 0 -t 2 FLAGS` until the block ends; yields a LiveServer."""
    log_path = log_dir / f"serve-{time.monotonic_ns()}.log"
    key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
    with serve_in_background(model, log_path, "-t", "2", *flags) as (proc, url):
        yield LiveServer(proc, url, log_path, key)
