"""A real `paxserve serve` process on 127.0.0.1 for the end-to-end server tests.

`ServerProcess` starts the command on a free port, waits for "paxserve listening on http://HOST:PORT"
on stderr and stops it with SIGTERM. `server` (session-scoped) is the main one that most tests
share: the bundled SmolLM2-135M-Instruct with small limits, an API key and --max-logprobs 8.
Helpers speak raw HTTP (http.client) where the openai client cannot express a case.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers import real_model_env

API_KEY = "sk-paxserve-test-key"
MODEL_NAME = "smol-test"
MAX_MODEL_LEN = 512
MAX_LOGPROBS = 8
VOCAB_SIZE = 49152  # the bundled SmolLM2-135M-Instruct
START_TIMEOUT_S = 240.0
# Small limits keep start-up and compilation short on a 2-core CPU; steps compile their own shapes
# when first needed (no background compiles competing with the tests' timed clients).
SMALL_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--no-warmup", "--kv-cache-memory-bytes", str(128 * 2**20),
              "--no-compile-in-background"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def paxserve_command() -> list[str]:
    """The installed `paxserve` console script next to this interpreter (what a user runs)."""
    exe = Path(sys.executable).parent / "paxserve"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("paxserve")
    return [found] if found else [sys.executable, "-m", "paxserve.server.cli"]


class ServerProcess:
    """One `paxserve serve` process; `stderr_text()` has everything it logged so far."""

    def __init__(self, args: list[str], api_key: str | None = None, env: dict[str, str] | None = None,
                 enforce_eager: bool = True) -> None:
        self.port = free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.api_key = api_key
        # --enforce-eager: the server tests' many buckets of the real 30-layer model compile ~3.5x faster
        # with the layers scanned; the unrolled layers give the same outputs bit for bit
        # (tests/models/test_layer_split.py) and serve every engine test.
        eager = ["--enforce-eager"] if enforce_eager and "--enforce-eager" not in args else []
        self.args = ["serve", "--host", self.host, "--port", str(self.port), *eager, *args]
        self._lines: list[str] = []  # stderr
        self._stdout_lines: list[str] = []
        self.listening_stream: str | None = None  # where "paxserve listening on ..." appeared
        self._ready = threading.Event()
        # A key in the developer's environment must not leak into servers that are meant to be open.
        self._env = {k: v for k, v in real_model_env().items() if k != "PAXSERVE_API_KEY"}
        self._env.update(env or {})
        self.proc: subprocess.Popen | None = None

    # ---- process ---------------------------------------------------------------------------------

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(
            [*paxserve_command(), *self.args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, errors="replace", env=self._env,
        )
        listening = f"paxserve listening on {self.url}"
        # Readiness is taken from either stream so that every test can run; test_lifecycle checks that
        # the line is on stderr, as the spec says.
        threading.Thread(target=self._pump, args=(self.proc.stderr, listening, "stderr"), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stdout, listening, "stdout"), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the pump threads collect the last lines
                pytest.fail(f"`paxserve {' '.join(self.args)}` exited with {self.proc.returncode} before "
                            f"listening:\n{self.stderr_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"`paxserve {' '.join(self.args)}` did not log {listening!r} within "
                            f"{START_TIMEOUT_S:.0f}s:\n{self.stderr_tail()}")
        return self

    def _pump(self, stream, marker: str, name: str) -> None:  # noqa: ANN001
        for line in stream:
            (self._lines if name == "stderr" else self._stdout_lines).append(line)
            if marker in line and self.listening_stream is None:
                self.listening_stream = name
                self._ready.set()

    def stderr_text(self) -> str:
        return "".join(self._lines)

    def stderr_tail(self, n: int = 60) -> str:
        out = "".join(self._stdout_lines[-10:])
        return "".join(self._lines[-n:]) + (f"\n[stdout]\n{out}" if out else "")

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after 20 s; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    # ---- clients ---------------------------------------------------------------------------------

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 120.0, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "unused",
                             max_retries=0, timeout=timeout)

    def async_client(self, timeout: float = 120.0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused",
                                  max_retries=0, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                headers: dict[str, str] | None = None, auth: bool = True,
                timeout: float = 120.0) -> "Response":
        """One raw HTTP request. `body` is sent as JSON; `raw` as the exact bytes."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            hdrs = {**(self.auth_headers() if auth else {}), **(headers or {})}
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            if data is not None:
                hdrs.setdefault("Content-Type", "application/json")
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kwargs: Any) -> "Response":
        return self.request("POST", path, body, **kwargs)

    def get(self, path: str, **kwargs: Any) -> "Response":
        return self.request("GET", path, **kwargs)

    # ---- metrics ---------------------------------------------------------------------------------

    def metrics(self) -> list[tuple[str, str, float]]:
        resp = self.get("/metrics", auth=False)
        assert resp.status == 200, resp.body
        return parse_metrics(resp.text)

    def metric(self, prefix: str, contains: str = "") -> float:
        """The summed value of the samples whose name starts with `prefix` (labels containing
        `contains`), skipping histogram/summary parts (_bucket, _sum, _count, _created)."""
        return metric_value(self.metrics(), prefix, contains)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is running or waiting and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics()
            state = {name: metric_value(samples, name) for name in
                     ("paxserve:num_requests_running", "paxserve:num_requests_waiting", "paxserve:kv_cache_usage")}
            if not any(state.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s: {state}")
            time.sleep(0.1)


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<{self.status} {self.body[:500]!r}>"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_PARTS = ("_bucket", "_sum", "_count", "_created")


def parse_metrics(text: str) -> list[tuple[str, str, float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        samples.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return samples


def metric_value(samples: list[tuple[str, str, float]], prefix: str, contains: str = "") -> float:
    found = [v for name, labels, v in samples
             if name.startswith(prefix) and contains in labels and not name.endswith(_PARTS)]
    assert found, f"no metric starting with {prefix!r} (labels containing {contains!r}); have " \
                  f"{sorted({name for name, _, _ in samples})}"
    return sum(found)


def sse_payloads(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the `data: ...\\n\\n` framing."""
    assert text.endswith("\n\n"), f"SSE body must end with a blank line: {text[-200:]!r}"
    payloads = []
    for event in text.split("\n\n")[:-1]:
        lines = [ln for ln in event.split("\n") if ln and not ln.startswith(":")]
        assert lines and all(ln.startswith("data: ") for ln in lines), f"bad SSE event {event!r}"
        payloads.append("\n".join(ln[len("data: "):] for ln in lines))
    return payloads


def assert_error(resp: Response, status: int, *, param: str | None = None, mentions: str | None = None) -> dict:
    """`resp` is an OpenAI error envelope with this status; returns the inner error object."""
    assert resp.status == status, resp
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    if mentions is not None:
        assert mentions.lower() in err["message"].lower(), err
    return err


def start_server(args: list[str], **kwargs: Any) -> ServerProcess:
    return ServerProcess(args, **kwargs).start()


@pytest.fixture(scope="session")
def server():
    """The shared server: small limits, served as MODEL_NAME behind API_KEY, --max-logprobs 8, tool
    calls in the model's own (Hermes) format parsed, cached prompt tokens in usage, the Responses
    API's store on."""
    srv = start_server([*SMALL_ARGS, "--max-num-seqs", "32", "--served-model-name", MODEL_NAME,
                        "--api-key", API_KEY, "--max-logprobs", str(MAX_LOGPROBS), "--seed", "0",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-tokenizer-info-endpoint",
                        "--enable-prompt-tokens-details", "--enable-response-store"],
                       api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()
