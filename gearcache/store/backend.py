"""The remote backend interface: a key-value store a fleet shares (after Triton's ``RemoteCacheBackend``).

A backend stores bytes under string keys and holds expiring claims; it knows nothing of entries, artifacts,
digests or signatures (``remote.py`` does). A backend is one short module (``redis_backend.py``); :func:`open_backend`
picks one by the URL's scheme. Contract of every method:

* it returns within the backend's timeout or raises :class:`RemoteError` (an ``OSError``): a dead, full or slow
  server is an error, never a hang;
* ``commit`` is atomic: a reader sees the value (and the ``keep`` keys made permanent) or nothing;
* ``put_temporary`` values expire after ``ttl_s`` unless a ``commit`` names them in ``keep`` (a writer killed
  mid-transfer leaves nothing that lives);
* it is safe to use after ``fork`` (a child opens its own connections).
"""
from __future__ import annotations



import abc
import errno
from typing import Iterator
from urllib.parse import urlsplit

from ..errors import ConfigError


class RemoteError(OSError):
    """The remote store failed (down, timed out, full, refused a command). Never fails a call: the local folder
    carries on alone (see docs/RELIABILITY.md, "Remote store")."""

    def __init__(self, url: str, what: str):
        super().__init__(errno.EIO, what, url)
        self.url, self.what = url, what

    def __str__(self) -> str:
        return f"remote store {self.url}: {self.what}"


class RemoteBackend(abc.ABC):
    """Bytes under string keys, shared by every process of a fleet."""

    url: str

    @abc.abstractmethod
    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The values of ``keys`` (None where a key is missing), in one round trip."""

    @abc.abstractmethod
    def put_temporary(self, items: dict[str, bytes], ttl_s: float) -> None:
        """Store ``items``, each expiring after ``ttl_s`` unless a later :meth:`commit` keeps it."""

    @abc.abstractmethod
    def commit(self, key: str, value: bytes, keep: list[str]) -> None:
        """Atomically make the ``keep`` keys permanent and set ``key`` to ``value``. Raises ``RemoteError`` (and
        changes nothing) when one of ``keep`` has expired or vanished."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Remove ``keys`` (missing ones are ignored)."""

    @abc.abstractmethod
    def scan(self, prefix: str) -> Iterator[str]:
        """Every key starting with ``prefix`` (not on any call path: CLI and housekeeping)."""

    @abc.abstractmethod
    def claim(self, key: str, owner: str, ttl_s: float) -> str | None:
        """Take the claim ``key`` for ``owner`` for ``ttl_s`` unless another owner holds it. Returns None when it is
        now ``owner``'s, else the current owner."""

    @abc.abstractmethod
    def refresh(self, key: str, owner: str, ttl_s: float) -> bool:
        """Extend ``owner``'s claim by ``ttl_s``; False when it is not ``owner``'s any more (it expired)."""

    @abc.abstractmethod
    def release(self, key: str, owner: str) -> None:
        """Drop the claim if ``owner`` still holds it."""

    def describe(self) -> dict:
        """Server facts for ``gearcache stats --remote`` (memory used, limit); may be empty."""
        return {}

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]


def backend_class(url: str) -> type[RemoteBackend]:
    """The backend class for ``url`` (``redis://host:port/db``, ``rediss://`` for TLS, ``unix:///path.sock``), its
    module imported (cheap: no client library, no connection). ``ConfigError`` for an unknown scheme."""
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        from .redis_backend import RedisBackend

        return RedisBackend
    raise ConfigError(f"remote={url!r}: unknown scheme {scheme!r}. Fix: use a redis://host:6379/0 URL "
                      f"(rediss:// for TLS, unix:///path/redis.sock)")


def open_backend(url: str, *, timeout_s: float) -> RemoteBackend:
    """The backend for ``url`` (see :func:`backend_class`); it connects at its first command."""
    return backend_class(url)(url, timeout_s=timeout_s)
