"""The remote backend interface: a key-value store a fleet shares (after Triton's ``RemoteCacheBackend``).

A backend stores bytes under string keys and holds expiring claims; it knows nothing of entries, artifacts,
digests or signatures (``remote.py`` does). A backend is one short module (``redis_remote_backend.py``);
``remote.REMOTE_BACKENDS`` maps a URL's scheme to its class (:func:`remote.open_backend`). Contract of every method:

* it returns within the backend's timeout or raises ``RemoteError`` (an ``OSError``, gearcache/errors.py): a dead,
  full or slow server is an error, never a hang;
* ``commit`` is atomic: a reader sees the value (and the ``keep`` keys made permanent) or nothing;
* ``put_temporary`` values expire after ``ttl_s`` unless a ``commit`` names them in ``keep`` (a writer killed
  mid-transfer leaves nothing that lives);
* it is safe to use after ``fork`` (a child opens its own connections).
"""
from __future__ import annotations

import abc
from typing import Any, Iterator

from ..errors import RemoteError

__all__ = ["RemoteBackend", "RemoteError"]


class RemoteBackend(abc.ABC):
    """Bytes under string keys, shared by every process of a fleet."""

    def __init__(self, url: str, *, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s

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
    def refresh_claim(self, key: str, owner: str, ttl_s: float) -> bool:
        """Extend ``owner``'s claim by ``ttl_s``; False when it is not ``owner``'s any more (it expired)."""

    @abc.abstractmethod
    def release_claim(self, key: str, owner: str) -> None:
        """Drop the claim if ``owner`` still holds it."""

    def describe(self) -> dict[str, Any]:
        """Server facts for ``gearcache stats --remote`` (memory used, limit); may be empty."""
        return {}

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]
