"""HMAC-SHA256 signatures of manifests (see docs/RELIABILITY.md, "Signing").

An artifact's ``MANIFEST.sig`` is the HMAC of ``MANIFEST.json``'s bytes; an entry manifest or gear plan carries a
``"sig"`` field, the HMAC of the canonical JSON (sorted keys, no spaces) of the rest.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any


def canonical_bytes(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=repr).encode()


def _hmac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def sign_json(key: bytes, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as it will read back from JSON, with ``"sig"``: HMAC-SHA256 over the canonical JSON of the rest."""
    plain: dict[str, Any] = json.loads(json.dumps(data, default=repr))
    plain.pop("sig", None)
    plain["sig"] = _hmac(key, canonical_bytes(plain))
    return plain


def json_signature_ok(key: bytes, data: dict[str, Any]) -> bool:
    sig = data.get("sig")
    if not isinstance(sig, str):
        return False
    rest = {k: v for k, v in data.items() if k != "sig"}
    return hmac.compare_digest(sig, _hmac(key, canonical_bytes(rest)))



def signature_problem(key: bytes | None, data: dict[str, Any]) -> str:
    """Why the JSON object ``data`` (an entry manifest, with its ``"sig"`` field) is not signed with ``key``; ``""``
    when it is, or when there is no key (nothing is checked)."""
    if key is None:
        return ""
    if "sig" not in data:
        return "it is not signed and a signing key is set"
    if not json_signature_ok(key, data):
        return "its signature does not match (tampered, or signed with another key)"
    return ""
