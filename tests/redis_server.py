"""A real ``redis-server`` for tests and benchmarks: started on a free loopback port in a temp folder, no persistence.

``redis-server`` must be on PATH (Debian: ``apt-get install -y redis-server``); without it, :func:`start` raises
with that fix: tests fail, never skip.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``args``: more redis-server options, e.g. ``("--unixsocket", path)`` or ``("--requirepass", pw)`` (which
    :meth:`client` then sends)."""

    def __init__(self, port: int | None = None, args: tuple[str, ...] = ()):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH; the fleet tests need a real one. Fix: "
                               "apt-get update && apt-get install -y redis-server (or your OS's redis package)")
        self.exe = exe
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="gearcache-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.args = tuple(args)
        self.password = dict(zip(self.args, self.args[1:])).get("--requirepass")

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--enable-debug-command", "local", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.02)

    def client(self, **kw):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **{"socket_timeout": 5, "password": self.password, **kw})

    def kill(self) -> None:
        """SIGKILL (a crash: nothing flushed)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def start() -> RedisServer:
    return RedisServer().start()
