"""``StoreConfig``: the options of one ``Store`` (its locks, size cap, signing key, shared folder, remote store)."""
from __future__ import annotations

import dataclasses

from ..config import CompilerConfig


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """The options of a ``Store``; the defaults are a private local folder, unsigned, without a size cap.

    ``lock_timeout_s``: how long a process waits for another compiling the same artifact (``LockTimeoutError``).
    ``lock_mode``: ``"flock"`` (kernel locks) or ``"soft"`` (lock files, for file systems without ``flock``).
    ``max_size``: bytes of artifacts the folder keeps (least recently used evicted first); None: no limit.
    ``signing_key``: HMAC key signing everything written and required of everything loaded (None: ``$GEARCACHE_
    SIGNING_KEY``, else unsigned). ``trust_shared_folder``: with a signing key, a folder shared by a group (0770).
    ``remote``: the remote store's URL (None: ``$GEARCACHE_REMOTE``; ``""``: none); ``remote_trust``: ``"signed"``
    or ``"unsigned-ok"``; ``remote_timeout_s``, ``remote_chunk_bytes``, ``remote_claim_ttl_s``: its transport
    (``remote.py``). Checked when the Store is made (``ConfigError``)."""

    lock_timeout_s: float = 900.0
    lock_mode: str = "flock"
    max_size: int | None = None
    signing_key: str | bytes | None = dataclasses.field(default=None, repr=False)
    trust_shared_folder: bool = False
    remote: str | None = None
    remote_trust: str = "signed"
    remote_timeout_s: float = 5.0
    remote_chunk_bytes: int = 4 << 20
    remote_claim_ttl_s: float = 20.0

    @classmethod
    def of(cls, config: CompilerConfig) -> StoreConfig:
        """The store options a ``CompilerConfig`` asks for."""
        return cls(**{field.name: getattr(config, field.name) for field in dataclasses.fields(cls)})
