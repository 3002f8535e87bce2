"""The Redis backend: ``remote="redis://host:6379/0"``. See ``remote_backend.py`` for the contract.

Reads (``get_many``: the whole fetch path of a warm node) go through ``resp.py``'s small reader, so a node that
only fetches never imports redis-py (~0.1 s of CPU); writes, claims, scans and server facts go through redis-py,
opened at their first use. A URL the reader does not handle (``rediss://``, URL options) is read by redis-py too.
Every command is bounded by ``timeout_s`` (connect and socket timeouts, no retries: a retry would multiply the wait);
claims are ``SET key owner NX PX ttl`` refreshed and dropped by compare-and-set scripts; ``commit`` is one Lua
script. Both clients' connection pools reopen their connections in a forked child.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, TypeVar

from . import resp
from ..errors import RemoteError
from .remote_backend import RemoteBackend

T = TypeVar("T")

_REFRESH = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# commit: every kept key must still exist (an expired chunk means the transfer is lost), then persist them, set key
_COMMIT = """
for i = 2, #KEYS do if redis.call('exists', KEYS[i]) == 0 then return 0 end end
for i = 2, #KEYS do redis.call('persist', KEYS[i]) end
redis.call('set', KEYS[1], ARGV[1])
return 1
"""


class RedisRemoteBackend(RemoteBackend):
    def __init__(self, url: str, *, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        target = resp.parse_url(url)
        self._reader = resp.Reader(target, timeout_s) if target is not None else None
        self._errors: tuple[type[BaseException], ...] = (OSError,)
        self._redis: tuple[Any, dict[str, Any]] | None = None
        self._open_lock = threading.Lock()

    def _redis_py(self) -> tuple[Any, dict[str, Any]]:
        """The redis-py client and its Lua scripts, created at first use (``RemoteError`` when redis-py is not
        installed)."""
        with self._open_lock:
            if self._redis is None:
                self._redis = self._open_redis_py()
        return self._redis

    @property
    def _client(self) -> Any:
        return self._redis_py()[0]

    def _script(self, name: str) -> Any:
        return self._redis_py()[1][name]

    def _open_redis_py(self) -> tuple[Any, dict[str, Any]]:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise RemoteError(self.url, "redis-py is not installed. Fix: pip install 'gearcache[fleet]' "
                                        "(or pip install 'redis>=5')") from None
        client = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                      socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0),
                                      retry_on_timeout=False)
        scripts = {name: client.register_script(text)
                   for name, text in (("refresh", _REFRESH), ("release", _RELEASE), ("commit", _COMMIT))}
        self._errors = (redis.RedisError, OSError)
        return client, scripts

    def _run(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise RemoteError(self.url, f"{what} failed ({type(exc).__name__}: {exc})") from exc

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        if self._reader is None:
            values: list[bytes | None] = self._run("MGET", lambda: self._client.mget(keys))    # redis-py: untyped
            return values
        return self._run("MGET", self._reader.mget, keys)

    def put_temporary(self, items: dict[str, bytes], ttl_s: float) -> None:
        def put() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(key, value, px=max(1, int(ttl_s * 1000)))
            pipe.execute()
        self._run("SET", put)

    def commit(self, key: str, value: bytes, keep: list[str]) -> None:
        if not self._run("commit", self._script("commit"), keys=[key, *keep], args=[value]):
            raise RemoteError(self.url, f"commit of {key} failed: a part expired or was evicted before it was "
                                        f"committed")

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._run("DEL", self._client.delete, *keys)

    def scan(self, prefix: str) -> Iterator[str]:
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        keys = self._run("SCAN", lambda: list(self._client.scan_iter(match=pattern, count=1000)))
        return (k.decode() for k in keys)

    def claim(self, key: str, owner: str, ttl_s: float) -> str | None:
        px = max(1, int(ttl_s * 1000))
        if self._run("SET NX", self._client.set, key, owner, nx=True, px=px):
            return None
        holder = self._run("GET", self._client.get, key)
        if holder is None:                              # expired between the two commands: try once more
            return None if self._run("SET NX", self._client.set, key, owner, nx=True, px=px) else "another process"
        text: str = holder.decode(errors="replace")
        return text

    def refresh_claim(self, key: str, owner: str, ttl_s: float) -> bool:
        px = max(1, int(ttl_s * 1000))
        return bool(self._run("PEXPIRE", self._script("refresh"), keys=[key], args=[owner, px]))

    def release_claim(self, key: str, owner: str) -> None:
        self._run("DEL", self._script("release"), keys=[key], args=[owner])

    def describe(self) -> dict[str, Any]:
        info = self._run("INFO", self._client.info, "memory")
        return {"used_memory": info.get("used_memory"), "maxmemory": info.get("maxmemory"),
                "maxmemory_policy": info.get("maxmemory_policy"), "keys": self._run("DBSIZE", self._client.dbsize)}
