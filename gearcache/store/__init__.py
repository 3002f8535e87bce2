"""The store: one local cache folder, safe for many processes and ranks at once (``Store``), optionally backed by a
remote store shared by a fleet (``remote.py``, ``remote_backend.py``). ``Store`` is a composition of typed parts
(``local.py`` lists them; ``store.artifacts``, ``store.entries``, ``store.leases``, ``store.maintenance``,
``store.sync``, ...), its options a ``StoreConfig``: ``Layout`` names every path below.

On-disk layout (format 1)::

    <root>/                                   created 0700
      artifacts/<akey>/                       content-addressed compiled graph, shared by every rank
          inductor/...                        torch's unpacked artifact: generated code, kernels (.so / cubins)
          MANIFEST.json                       {"format", "akey", "files": {relpath: sha256}, "bytes", ...}
          MANIFEST.sig                        with a signing key: HMAC-SHA256 of MANIFEST.json's bytes
      entries/<topology>/<method>/<ekey>.json entry manifest: key factors, signature, input/output recipes, akey
                                              (with a signing key: a "sig" field over the canonical JSON of the rest)
      index/                                  diskcache index: bookkeeping for ls/stats/eviction, never on the call path
      locks/<akey>.lock                       one lock per artifact: the process holding it compiles
      locks/<akey>.lease.lock                 held for a moment: shared while a lease is taken (loaders never wait
                                              for each other), exclusively while the artifact is evicted or pruned
      leases/<akey>/<pid>@<host>              "this process loaded the artifact": never evicted while the pid lives
      stamps/<akey>.json                      what the last full check of the artifact saw (stamps.py): a load of an
                                              unchanged artifact skips its digests; removed with the artifact
      tmp/<akey>.<pid>.<tag>                  work folders; a published artifact is renamed out of here
      quarantine/                             artifacts (and entry manifests) that failed a check, kept for inspection
      misses/<topology>/<method>/<ekey>.json  the key factors of a recorded miss (diagnostics.py)

Publishing is crash-safe: an artifact is built in ``tmp/``, its ``MANIFEST.json`` (and signature) written last, then the
folder is renamed into ``artifacts/`` (atomic); an entry manifest is written to a temp name and ``os.replace``-d, after
its artifact exists. A reader treats an artifact without a valid manifest, or whose files do not match their digests, as
corrupt: quarantined, never executed. The digests are computed once per artifact (at publish, or at the first full
check): a later load whose files still have the ``lstat`` its stamp recorded skips them (stamps.py). Leftovers of killed
processes (work folders, temp manifest files, leases, soft locks) are removed by ``store.maintenance.cleanup()``
(``Maintenance.cleanup``), run once by every Store that writes.
See docs/RELIABILITY.md for every fault and what happens.
"""
from __future__ import annotations

from .files import (HOST, HOST_TAG, MANIFEST, SIGNATURE, SIGNING_KEY_ENV, default_root, storage_fix,
                    write_json_atomic)
from .index import flush_index_updates
from .config import StoreConfig
from .local import Store
from .processes import _start_token, pid_alive
from .signing import canonical_bytes, json_signature_ok, sign_json

__all__ = ["HOST", "HOST_TAG", "MANIFEST", "SIGNATURE", "SIGNING_KEY_ENV", "Store", "StoreConfig", "canonical_bytes",
           "default_root", "flush_index_updates", "json_signature_ok", "pid_alive", "sign_json", "storage_fix",
           "write_json_atomic", "_start_token"]
