"""Cache keys built from ordered, named factors (after JAX's ``cache_key.py``).

A key is ``sha256`` over the lines ``"<name>=<sha256 of the factor's canonical JSON>"`` in factor order. Every factor
is stored in the entry's manifest and each factor's hash is logged at DEBUG, so ``gearcache explain`` can say which
factor made a miss.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
from typing import Any, Callable, Iterable

log = logging.getLogger("gearcache.key")

FORMAT_VERSION = 4
"""gearcache's artifact and manifest format. Bump it whenever what is written or how it is read changes.
2: artifacts carry a run plan (gearcache/runplan/); the config factor names the mode instead of its options.
3: run plans also launch the kernels Inductor left to Triton's launcher (long names, clusters, scratch memory).
4: the process groups are a factor of entry and artifact keys; run plans for graphs with collectives."""


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def sha256_text(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def factor_hash(value: Any) -> str:
    return sha256_text(canonical_json(value))


def build_key(kind: str, factors: Iterable[tuple[str, Any]]) -> tuple[str, dict[str, str]]:
    """Return ``(key, {factor name: factor hash})`` for the ordered ``(name, value)`` factors."""
    hashes: dict[str, str] = {}
    lines = []
    for name, value in factors:
        h = factor_hash(value)
        hashes[name] = h
        lines.append(f"{name}={h}")
        log.debug("%s key factor %s: %s", kind, name, h)
    key = sha256_text("\n".join(lines))[:40]
    log.debug("%s key: %s", kind, key)
    return key, hashes


def source_digest(obj: Any) -> str:
    """sha256 of an object's source text; its qualified name where there is no source (a builtin, a C op)."""
    try:
        return sha256_text(inspect.getsource(obj))
    except (OSError, TypeError):
        return sha256_text(f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}")


def decompositions_factor(decompositions: dict[Any, Callable] | None) -> list[list[str]]:
    """Custom decompositions as ``[[op name, source digest of the function], ...]`` sorted by op."""
    if not decompositions:
        return []
    return sorted([str(op), source_digest(fn)] for op, fn in decompositions.items())
