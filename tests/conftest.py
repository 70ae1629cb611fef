"""Shared fixtures: a tiny target/draft checkpoint pair, and servers to test against.

- tiny_pair: (target, draft) directories; the draft is the target with noise added to its weights,
  so speculation accepts some drafts and rejects others (greedy acceptance about 0.55, sampled
  about 0.95 at temperature 1): rejection and rollback run wherever it is used.
- ServerProcess: `specserve serve ...` in a subprocess on a free loopback port (the real thing).
- InProcessServer: uvicorn in a thread of the test process around an app we built, so a test can
  reach into the engine (slow it down, make it fail) while clients talk HTTP to it.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    from helpers import make_noisy_copy, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_pair")
    target = make_tiny_checkpoint(root / "target", arch="llama", seed=0)
    return target, make_noisy_copy(target, root / "draft", noise=0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 2.0):
    import httpx
    return httpx.get(url, timeout=timeout)


def stop_process(process: subprocess.Popen | None) -> None:
    """SIGTERM, and SIGKILL if it is still there 15 s later."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until_idle(url: str, timeout: float = 10.0) -> dict:
    """/health once no request is left in the engine and every KV block is free again."""
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        if health["num_requests"] == 0 and health["kv_blocks_free"] == health["kv_blocks_total"]:
            return health
        assert time.monotonic() < deadline, f"the engine is not idle {timeout} s after the last request: {health}"
        time.sleep(0.05)


class ServerProcess:
    """`specserve serve` in a subprocess; start() returns at once, wait_ready() blocks until /health is 200."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        script = Path(sys.executable).parent / "specserve"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "server.cli"]
        self.command = command + ["serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, **SERVER_ENV, **(env or {})}
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if _get(self.url + "/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        stop_process(self.process)


class InProcessServer:
    """uvicorn serving `app` from a thread of the test process."""

    def __init__(self, app):
        import uvicorn
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "InProcessServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def sse_events(response) -> list:
    """The `data:` payloads of a streamed response (an httpx.Response, or the rest of its
    iter_lines() iterator), JSON-decoded; "[DONE]" as is."""
    import json
    events = []
    for line in response.iter_lines() if hasattr(response, "iter_lines") else response:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# Fixtures that start real server processes: their tests are slow (`make test-fast` skips them).
SERVER_PROCESS_FIXTURES = {"launched"}


def pytest_collection_modifyitems(config, items):
    """Tests on real server processes are slow; `@pytest.mark.gpu` tests need CUDA: skip them,
    with the reason, where there is none."""
    import torch

    for item in items:
        if SERVER_PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
