"""If the engine loop dies anyway (a bug outside a step's own failure isolation), the in-flight
request gets a clean 503, /health stops answering 200, and the process exits with status 1 within
5 s, so that a supervisor restarts it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import free_port
from tests.paxserve.test_engine import tiny_dir  # noqa: F401

SCRIPT = Path(__file__).resolve().parent / "scripts" / "dying_server.py"


def test_engine_death_is_a_503_then_the_process_exits_1_within_5_s(tiny_dir: Path) -> None:  # noqa: F811
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tiny_dir), str(port)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "paxserve listening on" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(180), "".join(lines[-30:])
        url = f"http://127.0.0.1:{port}"
        assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200
        body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        started = time.monotonic()
        try:
            urllib.request.urlopen(request, timeout=30)
            raise AssertionError("the request should have failed: its engine died")
        except urllib.error.HTTPError as e:
            assert e.code == 503
            error = json.loads(e.read())["error"]
        assert "0x" not in error["message"] and "Traceback" not in error["message"], error
        try:  # whatever /health says now, it must not be healthy
            status = urllib.request.urlopen(f"{url}/health", timeout=5).status
        except urllib.error.HTTPError as e:
            status = e.code
        except OSError:
            status = None  # already stopped listening
        assert status != 200
        code = proc.wait(timeout=10)
        elapsed = time.monotonic() - started
        assert code == 1, "".join(lines[-30:])
        assert elapsed < 5.0, f"exited {elapsed:.1f}s after the death"
        assert any("engine died" in line for line in lines), "".join(lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
