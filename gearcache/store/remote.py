"""A remote store behind the local folder: one compile per fleet, entries fetched by machines that share no folder.

Remote layout (``P`` = ``gearcache:f<FORMAT_VERSION>:``; values are bytes)::

    P entry:<topology>/<method>/<ekey>   the entry manifest's JSON, exactly as written locally (signed: "sig")
    P artifact:<akey>                    head: {"format", "akey", "manifest": MANIFEST.json text, "sig": MANIFEST.sig
                                         text or null, "files": [[relpath, bytes, mode], ...] (MANIFEST's order),
                                         "bundle": sha256 of the bundle, "bytes", "chunks": n}
    P chunk:<akey>:<bundle[:16]>:<i>     the bundle (every listed file's bytes, concatenated) cut into chunks
    P claim:<akey>                       "host/pid": that process compiles the artifact (expires unless refreshed)

Writes: chunks first, each expiring after an hour; then one atomic commit makes them permanent *and* sets the
head, then the entry key. A reader needs the head and every chunk: a missing chunk is a miss; in memory, before
anything is written, the bundle's length, every file's digest and, with a signing key, ``MANIFEST.sig`` and the
entry's ``"sig"`` are checked; then the files are written into a work folder renamed into ``artifacts/`` with the
local folder's usual steps. (The bundle's sha256 names its chunks; the file digests, under the signature, are what
a reader checks.) What fails a check is refused (``counters.remote_refused``, a warning) and rebuilt; it is never
executed.

A remote fault (down, timed out, full) is a ``RemoteError`` (gearcache/errors.py): logged once per process and kind,
counted in ``counters.remote_errors``, and the remote is left alone for ``DOWN_BACKOFF_S`` (so a dead server costs one
timeout, not one per miss); the local folder works on alone.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import threading
import time
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from ..counters import counters
from ..errors import CacheCorruptionError, ConfigError, RemoteError, shown_url
from ..keys.key import FORMAT_VERSION
from .artifacts import Artifacts, CheckedFile
from .files import HOST, MANIFEST, SIGNATURE
from .redis_remote_backend import RedisRemoteBackend
from .remote_backend import RemoteBackend
from .signing import json_signature_ok, signature_problem

log = logging.getLogger("gearcache.store")

REMOTE_ENV = "GEARCACHE_REMOTE"
TRUST = ("signed", "unsigned-ok")
CHUNK_TTL_S = 3600.0             # an uncommitted chunk (its writer died mid-transfer) expires after this
DOWN_BACKOFF_S = 30.0            # after a fault, the remote is not tried again for this long
_POLL_S = (0.05, 0.5)            # a waiter polls for the claimer's artifact, backing off between these

# The backend class of each URL scheme (``redis://host:port/db``, ``rediss://`` for TLS, ``unix:///path.sock``).
REMOTE_BACKENDS: dict[str, type[RemoteBackend]] = {
    "redis": RedisRemoteBackend, "rediss": RedisRemoteBackend, "unix": RedisRemoteBackend}


def backend_class(url: str) -> type[RemoteBackend]:
    """The backend class for ``url``, by its scheme (:data:`REMOTE_BACKENDS`; cheap: no client library, no
    connection). ``ConfigError`` for an unknown scheme."""
    scheme = urlsplit(url).scheme
    if scheme in REMOTE_BACKENDS:
        return REMOTE_BACKENDS[scheme]
    raise ConfigError(f"remote={shown_url(url)!r}: unknown scheme {scheme!r}. Fix: use a redis://host:6379/0 URL "
                      f"(rediss:// for TLS, unix:///path/redis.sock)")


def open_backend(url: str, *, timeout_s: float) -> RemoteBackend:
    """The backend for ``url`` (see :func:`backend_class`); it connects at its first command."""
    return backend_class(url)(url, timeout_s=timeout_s)


class RemoteStore:
    """The remote tier of one ``Store``: bytes checked in memory in, ``Artifacts.install`` out (its only use of the
    local folder, with ``Artifacts.check_manifest`` and ``Artifacts.folder``). Cheap to create: the backend class is
    picked here (``ConfigError`` for an unknown scheme), the backend is opened at first use."""

    def __init__(self, url: str, *, trust: str = "signed", signing_key: bytes | None = None, timeout_s: float = 5.0,
                 chunk_bytes: int = 4 << 20, claim_ttl_s: float = 20.0, prefix: str | None = None):
        self.url, self.trust, self._key = url, trust, signing_key     # ``url`` connects; nothing shows it
        self.shown = shown_url(url)                 # what logs, errors, the index and the CLI show: no password
        self.timeout_s, self.chunk_bytes, self.claim_ttl_s = timeout_s, chunk_bytes, claim_ttl_s
        self.prefix = prefix if prefix is not None else f"gearcache:f{FORMAT_VERSION}:"
        self._backend_class = backend_class(url)
        self._backend: RemoteBackend | None = None
        self._down_until = 0.0
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"RemoteStore({self.shown!r}, trust={self.trust!r})"

    # ----------------------------------------------------------------------------------------------- plumbing
    @property
    def backend(self) -> RemoteBackend:
        if self._backend is None:
            self._backend = self._backend_class(self.url, timeout_s=self.timeout_s)
        return self._backend

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, exc: RemoteError, consequence: str) -> None:
        """Record a fault: counted, warned once per kind, and the remote left alone for ``DOWN_BACKOFF_S``."""
        counters.add(remote_errors=1)
        self._down_until = time.monotonic() + DOWN_BACKOFF_S
        kind = exc.what.split(" failed", 1)[0]
        level = logging.WARNING if kind not in self._warned else logging.DEBUG
        self._warned.add(kind)
        log.log(level, "%s; %s (the local folder carries on alone; the remote is tried again in %g s)", exc,
                consequence, DOWN_BACKOFF_S)

    def refused(self, what: str, why: str) -> None:
        counters.add(remote_refused=1)
        log.warning("refused %s from the remote store %s: %s; it is not loaded, and is rebuilt here", what, self.shown,
                    why)

    def entry_key(self, topology: str, method: str, ekey: str) -> str:
        return f"{self.prefix}entry:{topology}/{method}/{ekey}"

    def head_key(self, akey: str) -> str:
        return f"{self.prefix}artifact:{akey}"

    def claim_key(self, akey: str) -> str:
        return f"{self.prefix}claim:{akey}"

    def chunk_keys(self, akey: str, bundle: str, n: int) -> list[str]:
        return [f"{self.prefix}chunk:{akey}:{bundle[:16]}:{i}" for i in range(n)]

    # -------------------------------------------------------------------------------------------------- entries
    def fetch_entry(self, topology: str, method: str, ekey: str) -> dict[str, Any] | None:
        """The remote entry manifest (signature checked, ``"sig"`` kept for writing it locally), or None."""
        raw = self.backend.get(self.entry_key(topology, method, ekey))
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            self.refused(f"entry {ekey}", "its manifest is not JSON (corrupted)")
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or data.get("ekey") != ekey \
                or not isinstance(data.get("akey"), str):
            self.refused(f"entry {ekey}", "its manifest names another format or key (corrupted)")
            return None
        why = self._signature_problem(data)
        if why:
            self.refused(f"entry {ekey}", why)
            return None
        return data

    def _signature_problem(self, data: dict[str, Any]) -> str:
        if self._key is None:
            return ""                       # remote_trust="unsigned-ok" (Store refuses a remote otherwise)
        if "sig" not in data:
            return "it is not signed and a signing key is set"
        if not json_signature_ok(self._key, data):
            return "its signature does not match (tampered, or signed with another key)"
        return ""

    def push_entry(self, topology: str, method: str, ekey: str, signed: dict[str, Any]) -> None:
        self.backend.commit(self.entry_key(topology, method, ekey), json.dumps(signed, sort_keys=True).encode(), [])

    # ------------------------------------------------------------------------------------------------ artifacts
    def fetch_artifact(self, artifacts: Artifacts, akey: str) -> bool:
        """Fetch artifact ``akey`` into the local folder: checked in memory (signature, trust, every file's digest:
        :func:`checked_files`), then installed (``Artifacts.install``: written into a work folder, renamed into
        ``artifacts/``, the next load's check skipped once). The caller holds the artifact's local lock. False when
        the remote has no complete, valid copy. Raises ``RemoteError``."""
        parts = self._read_bundle(akey)
        if parts is None:
            return False
        head, bundle = parts
        try:
            files = checked_files(artifacts, akey, head, bundle)
            artifacts.install(akey, files, head["manifest"], head.get("sig"), origin=self.shown, size=head["bytes"])
        except (CacheCorruptionError, ValueError) as exc:
            self.refused(f"artifact {akey}", getattr(exc, "reason", None) or str(exc))
            return False
        counters.add(remote_loads=1)
        log.info("fetched artifact %s (%d bytes, %d chunk(s)) from %s", akey, head["bytes"], head["chunks"], self.shown)
        return True

    def _read_bundle(self, akey: str) -> tuple[dict[str, Any], bytes] | None:
        """The head and the bundle (every chunk, joined; its length checked), or None: no head, a missing chunk
        (a miss), or an unreadable head (refused). The bundle's content is checked file by file against the signed
        manifest (:func:`checked_files`), not by hashing it whole once more."""
        raw = self.backend.get(self.head_key(akey))
        if raw is None:
            return None
        try:
            head = json.loads(raw)
            n, bundle_sha = int(head["chunks"]), str(head["bundle"])
            if head.get("format") != FORMAT_VERSION or head.get("akey") != akey or not isinstance(head["files"], list):
                raise ValueError("it names another format or key")
        except (ValueError, KeyError, TypeError) as exc:
            self.refused(f"artifact {akey}", f"its head is unreadable ({exc})")
            return None
        chunks = self.backend.get_many(self.chunk_keys(akey, bundle_sha, n))
        present = [c for c in chunks if c is not None]
        if len(present) != len(chunks):
            log.info("remote artifact %s is incomplete (chunk %d of %d missing: evicted, or its writer died); a miss",
                     akey, chunks.index(None), n)
            return None
        bundle = present[0] if n == 1 else b"".join(present)
        if len(bundle) != head.get("bytes"):
            self.refused(f"artifact {akey}", f"its chunks hold {len(bundle)} bytes, its head says {head.get('bytes')} "
                                             f"(truncated or corrupted)")
            return None
        return head, bundle

    def push_artifact(self, artifacts: Artifacts, akey: str) -> None:
        """Upload the local (verified) artifact ``akey``: chunks (expiring), then the head in one atomic commit that
        makes them permanent. Raises ``RemoteError``."""
        folder = artifacts.folder(akey)
        manifest_text = (folder / MANIFEST).read_text()
        files = json.loads(manifest_text)["files"]
        sig = (folder / SIGNATURE).read_text() if (folder / SIGNATURE).exists() else None
        rows, blobs = [], []
        for rel in files:                       # the manifest's (sorted) order
            data = (folder / rel).read_bytes()
            rows.append([rel, len(data), os.stat(folder / rel).st_mode & 0o755])
            blobs.append(data)
        bundle = b"".join(blobs)
        bundle_sha = hashlib.sha256(bundle).hexdigest()
        n = max(1, -(-len(bundle) // self.chunk_bytes))
        keys = self.chunk_keys(akey, bundle_sha, n)
        for i in range(0, n, 16):               # at most 16 chunks per round trip
            self.backend.put_temporary({k: bundle[j * self.chunk_bytes:(j + 1) * self.chunk_bytes]
                                        for j, k in enumerate(keys) if i <= j < i + 16}, CHUNK_TTL_S)
        head = {"format": FORMAT_VERSION, "akey": akey, "manifest": manifest_text, "sig": sig, "files": rows,
                "bundle": bundle_sha, "bytes": len(bundle), "chunks": n, "from": f"{HOST}/{os.getpid()}"}
        replaced = self._old_chunks(akey, bundle_sha)
        self.backend.commit(self.head_key(akey), json.dumps(head).encode(), keys)
        self.backend.delete(replaced)           # a reader still fetching them sees a missing chunk: a miss
        counters.add(remote_pushes=1)
        log.info("pushed artifact %s (%d bytes, %d chunk(s)) to %s", akey, len(bundle), n, self.shown)

    def _old_chunks(self, akey: str, bundle_sha: str) -> list[str]:
        """The chunk keys of the head about to be replaced (a damaged or older bundle of ``akey``)."""
        try:
            old = json.loads(self.backend.get(self.head_key(akey)) or b"null")
            if isinstance(old, dict) and old.get("bundle") != bundle_sha:
                return self.chunk_keys(akey, str(old["bundle"]), int(old["chunks"]))
        except (ValueError, KeyError, TypeError):
            pass
        return []

    # --------------------------------------------------------------------------------------------------- claims
    def publish(self, artifacts: Artifacts, akey: str, build_here: Callable[[], int], wait_s: float) -> int | None:
        """One compile per fleet: fetch ``akey`` if the remote has it (None), else claim it, build here and push
        (the size), else wait for the claimer (bounded by ``wait_s``, one log line naming it) and fetch. A claimer
        that dies stops refreshing its claim, which expires: a waiter takes over. After ``wait_s``, or on a remote
        fault, builds here without the fleet."""
        me = f"{HOST}/{os.getpid()}"
        deadline = time.monotonic() + wait_s
        waited_for, delay = None, _POLL_S[0]
        try:
            while True:
                seen = self.backend.get(self.head_key(akey))
                if seen is not None and self.fetch_artifact(artifacts, akey):
                    return None
                holder = self.backend.claim(self.claim_key(akey), me, self.claim_ttl_s)
                if holder is None:
                    if self.backend.get(self.head_key(akey)) not in (None, seen) and \
                            self.fetch_artifact(artifacts, akey):       # pushed just before its claimer let go
                        self.backend.release_claim(self.claim_key(akey), me)
                        return None
                    break
                if waited_for != holder:
                    waited_for = holder
                    counters.add(remote_waits=1)
                    log.info("artifact %s: waiting for %s, which compiles it for the fleet (up to %g s)", akey,
                             holder, max(0.0, deadline - time.monotonic()))
                if time.monotonic() > deadline:
                    log.warning("artifact %s: %s did not publish it within %g s; compiling it here", akey, holder,
                                wait_s)
                    return build_here()
                time.sleep(delay)
                delay = min(delay * 2, _POLL_S[1])
        except RemoteError as exc:
            self.failed(exc, f"artifact {akey} is compiled here")
            return build_here()
        with self._heartbeat(akey, me):
            size = build_here()
            try:
                self.push_artifact(artifacts, akey)
            except (RemoteError, OSError) as exc:
                self.failed(exc if isinstance(exc, RemoteError) else RemoteError(self.url, f"push failed ({exc})"),
                            f"artifact {akey} stays local")
        return size

    @contextlib.contextmanager
    def _heartbeat(self, akey: str, me: str) -> Iterator[None]:
        """Refresh the claim every third of its ttl while the body runs; drop it after."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.claim_ttl_s / 3):
                try:
                    if not self.backend.refresh_claim(self.claim_key(akey), me, self.claim_ttl_s):
                        log.info("artifact %s: the claim expired while compiling (another process may compile it "
                                 "too)", akey)
                        return
                except RemoteError as exc:
                    log.debug("claim refresh of %s failed: %s", akey, exc)

        thread = threading.Thread(target=beat, name=f"gearcache-claim-{akey[:8]}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            with contextlib.suppress(RemoteError):
                self.backend.release_claim(self.claim_key(akey), me)

    # ------------------------------------------------------------------------------------------------- listing
    def entries(self) -> Iterator[tuple[str, str, str]]:
        """``(topology, method, ekey)`` of every remote entry."""
        start = f"{self.prefix}entry:"
        for key in self.backend.scan(start):
            parts = key[len(start):].split("/")
            if len(parts) == 3:
                yield parts[0], parts[1], parts[2]

    def artifacts(self) -> list[str]:
        start = f"{self.prefix}artifact:"
        return sorted(k[len(start):] for k in self.backend.scan(start))

    # ------------------------------------------------------------------- for tools (gearcache ls --remote, ...)
    def entry_manifest(self, topology: str, method: str, ekey: str) -> dict[str, Any] | None:
        """The remote entry manifest as stored, unchecked (for listing); {} when it is not a JSON object, None when
        there is none. :meth:`signature_problem` says whether a node would load it."""
        raw = self.backend.get(self.entry_key(topology, method, ekey))
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def signature_problem(self, data: dict[str, Any]) -> str:
        """Why a node refuses the entry manifest ``data`` for its signature; ``""`` when it does not."""
        return signature_problem(self._key, data)

    def head(self, akey: str) -> dict[str, Any] | None:
        """Artifact ``akey``'s head as stored, unchecked (the module docstring); ``{"unreadable": True}`` when it is
        not JSON, None when there is none."""
        raw = self.backend.get(self.head_key(akey))
        if raw is None:
            return None
        try:
            head = json.loads(raw)
        except ValueError:
            return {"unreadable": True}
        return head if isinstance(head, dict) else {"unreadable": True}

    def artifact_problem(self, artifacts: Artifacts, akey: str) -> str:
        """Why a fetch of artifact ``akey`` into the local folder would be refused or miss (incomplete, unreadable, a
        file or the signature failing :func:`checked_files`), checked in memory: nothing is written. ``""``: it would
        not."""
        parts = self._read_bundle(akey)
        if parts is None:
            return "missing, incomplete or unreadable (see the log)"
        try:
            checked_files(artifacts, akey, *parts)
        except (CacheCorruptionError, ValueError) as exc:
            return getattr(exc, "reason", None) or str(exc)
        return ""

    def garbage_keys(self, bad_akeys: set[str]) -> list[str]:
        """The keys ``gearcache prune --remote --corrupt`` deletes: the heads of ``bad_akeys``, the entries naming
        one of them or an artifact without a head (or that are unreadable), and the chunks no other head names."""
        gone = [self.head_key(akey) for akey in sorted(bad_akeys)]
        heads = {akey: self.head(akey) for akey in self.artifacts() if akey not in bad_akeys}
        for topology, method, ekey in sorted(self.entries()):
            data = self.entry_manifest(topology, method, ekey)
            if not data or data.get("akey") in bad_akeys or heads.get(str(data.get("akey"))) is None:
                gone.append(self.entry_key(topology, method, ekey))
        live = {self.chunk_keys(akey, str(head["bundle"]), 1)[0].rsplit(":", 1)[0]
                for akey, head in heads.items() if head and "bundle" in head}
        return gone + [k for k in self.backend.scan(f"{self.prefix}chunk:") if k.rsplit(":", 1)[0] not in live]


def checked_files(artifacts: Artifacts, akey: str, head: dict[str, Any], bundle: bytes) -> list[CheckedFile]:
    """The bundle cut into the head's files ``(relative path, bytes, mode)``, after the checks ``Artifacts.verify``
    makes on a folder, made in memory before anything is written: the manifest's signature (with a key), format and
    key (``Artifacts.check_manifest``); every path safe (relative, no ``..``); exactly the manifest's files, each
    matching its sha256 digest; the sizes adding up to the bundle. Raises ``CacheCorruptionError`` or ``ValueError``."""
    where = f"remote artifact {akey}"
    files = artifacts.check_manifest(akey, str(head["manifest"]).encode(), head.get("sig"), where)
    view, rows, offset = memoryview(bundle), [], 0
    for rel, size, mode in head["files"]:
        parts = pathlib.PurePosixPath(rel).parts if isinstance(rel, str) else ()
        if not parts or rel.startswith("/") or ".." in parts or "\\" in rel:
            raise ValueError(f"the head lists an unsafe path {rel!r}")
        if rel not in files:
            raise CacheCorruptionError(where, f"{rel} is not listed in MANIFEST.json")
        data = view[offset:offset + int(size)]
        offset += int(size)
        if hashlib.sha256(data).hexdigest() != files[rel]:
            raise CacheCorruptionError(where, f"{rel} does not match its sha256 digest")
        rows.append((rel, data, int(mode) & 0o755))
    if offset != len(bundle):
        raise ValueError("the head's file sizes do not add up to the bundle")
    missing = set(files) - {rel for rel, _, _ in rows}
    if missing:
        raise CacheCorruptionError(where, f"{sorted(missing)[0]} is missing")
    return rows
