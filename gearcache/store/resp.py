"""A small Redis reader for the fetch path (``GET`` / ``MGET`` over RESP2 on a plain socket), so that a warm node's
first call never imports redis-py: ``import redis`` costs ~0.1 s of CPU, which was most of a warm-Redis first call
(benchmarks/fleet.py). Writes, claims, scans and server facts stay with redis-py (``redis_remote_backend.py``).

Scope: :func:`parse_url` accepts ``redis://[[user]:password@]host[:port][/db]`` and ``unix:///path[?db=n]`` and
returns None for anything else (``rediss://``, other URL options), which stays with redis-py. Contract:

* every socket operation (connect, send, each receive) is bounded by ``timeout_s``, as redis-py's
  ``socket_connect_timeout`` / ``socket_timeout``; no retries;
* a fault is an ``OSError``: refused, reset, timed out, closed mid-reply, or :class:`ReplyError` (the server answered
  an error, or its reply breaks the protocol: a value over Redis's own 512 MiB limit, a malformed line);
* connections are pooled (a thread takes an idle one or opens its own, so threads never share a socket); one that
  failed is closed, never reused; a forked child closes its parent's and opens its own.
"""
from __future__ import annotations

import io
import os
import socket
import threading
from typing import Any, Callable, NamedTuple, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import ReplyError

MAX_BULK = 512 << 20             # Redis's proto-max-bulk-len default: no value it stores is larger
_MAX_LINE = 64 << 10             # a status, error or length line


class Target(NamedTuple):
    host: str
    port: int
    path: str | None             # a unix socket, else TCP to host:port
    db: int
    username: str | None
    password: str | None


def parse_url(url: str) -> Target | None:
    """The server ``url`` names (read as redis-py reads it), or None when this reader leaves ``url`` to redis-py:
    another scheme (``rediss://``), URL options other than ``db``, a user without a password, a malformed part."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme not in ("redis", "unix") or set(query) - {"db"}:
        return None
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    if username is not None and password is None:
        return None
    try:
        if parts.scheme == "unix":
            db = int(query["db"][0]) if "db" in query else 0
            return Target("", 0, unquote(parts.path), db, username, password) if parts.path else None
        db = int(query["db"][0] if "db" in query else unquote(parts.path).replace("/", "") or 0)
        return Target(unquote(parts.hostname or "localhost"), parts.port or 6379, None, db, username, password)
    except ValueError:
        return None


def encode(args: Sequence[bytes | str]) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else bytes(arg)
        out += [b"$%d\r\n" % len(data), data, b"\r\n"]
    return b"".join(out)


def read_reply(f: io.BufferedReader, depth: int = 0) -> Any:
    """One reply from ``f``: bytes (bulk or status), int, None (nil), or a list (at most one level deep: MGET).
    Raises ``ReplyError`` for an error reply or a protocol violation, ``ConnectionError`` when the stream ends."""
    line = f.readline(_MAX_LINE)
    if not line.endswith(b"\r\n"):
        if line.endswith(b"\n") or len(line) >= _MAX_LINE:
            raise ReplyError("malformed reply line")
        raise ConnectionError("the server closed the connection mid-reply")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise ReplyError(rest[:200].decode(errors="replace"))
    if kind == b":":
        return _number(rest, None)
    if kind == b"$":
        return _bulk(f, _number(rest, MAX_BULK))
    if kind == b"*" and depth == 0:
        n = _number(rest, 1 << 24)
        return None if n < 0 else [read_reply(f, 1) for _ in range(n)]
    raise ReplyError(f"unexpected reply type {kind!r}")


def _number(text: bytes, limit: int | None) -> int:
    """An integer reply, or a length (``limit``: the largest allowed; -1 is nil)."""
    try:
        n = int(text)
    except ValueError:
        raise ReplyError(f"malformed number {text[:20]!r}") from None
    if limit is not None and not -1 <= n <= limit:
        raise ReplyError(f"length {n} out of range")
    return n


def _bulk(f: io.BufferedReader, n: int) -> bytes | None:
    if n < 0:
        return None
    data, end = f.read(n), f.read(2)
    if len(data) != n or len(end) != 2:
        raise ConnectionError("the server closed the connection mid-reply")
    if end != b"\r\n":
        raise ReplyError("a bulk value does not end with CRLF")
    return data


def _connect(target: Target, timeout_s: float) -> socket.socket:
    """A connected socket whose every operation times out after ``timeout_s``."""
    if target.path is None:             # an ASCII name as bytes: getaddrinfo skips the idna codec (2 ms to import)
        host = target.host.encode() if target.host.isascii() else target.host
        sock = socket.create_connection((host, target.port),  # type: ignore[arg-type]  # typeshed: str; bytes work
                                        timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(target.path)
    except BaseException:
        sock.close()
        raise
    return sock


class Connection:
    """One socket to the server (authenticated, database selected); every operation bounded by ``timeout_s``."""

    def __init__(self, target: Target, timeout_s: float):
        self.sock = _connect(target, timeout_s)
        try:
            self.file = self.sock.makefile("rb")
            if target.password is not None:
                self.call(["AUTH", *([target.username] if target.username else []), target.password])
            if target.db:
                self.call(["SELECT", str(target.db)])
        except BaseException:
            self.close()
            raise

    def call(self, args: Sequence[bytes | str]) -> Any:
        self.sock.sendall(encode(args))
        return read_reply(self.file)

    def close(self) -> None:
        for thing in (getattr(self, "file", None), getattr(self, "sock", None)):
            if thing is not None:
                try:
                    thing.close()
                except OSError:
                    pass


def _values(reply: Any, n: int) -> list[bytes | None]:
    if not isinstance(reply, list) or len(reply) != n or not all(v is None or isinstance(v, bytes) for v in reply):
        raise ReplyError("MGET's reply does not match its keys")
    return reply


class Reader:
    """Read-only commands against one server, from any thread; connections opened at first use and pooled."""

    def __init__(self, target: Target, timeout_s: float):
        self.target, self.timeout_s = target, timeout_s
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def command(self, *args: bytes | str) -> Any:
        """Send one command, return its reply. Raises ``OSError`` (``ReplyError`` included) on any fault; the
        connection it used is closed then."""
        return self._call(args, lambda reply: reply)

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` (None where missing) in one round trip; a reply of another shape is a
        ``ReplyError``."""
        values: list[bytes | None] = self._call(["MGET", *keys], lambda reply: _values(reply, len(keys)))
        return values

    def _call(self, args: Sequence[bytes | str], check: Callable[[Any], Any]) -> Any:
        conn = self._take()
        try:
            reply = check(conn.call(args))
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.append(conn)
        return reply

    def _take(self) -> Connection:
        with self._lock:
            if self._pid != os.getpid():         # a forked child: the sockets are the parent's
                stale, self._idle, self._pid = self._idle, [], os.getpid()
                for conn in stale:
                    conn.close()
            if self._idle:
                return self._idle.pop()
        return Connection(self.target, self.timeout_s)
