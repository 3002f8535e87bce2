"""The fleet commands of ``gearcache``: ``push``, ``pull``, and ``ls``/``inspect``/``verify``/``stats``/``prune`` with
``--remote URL`` (else ``$GEARCACHE_REMOTE``). Layout of the remote store: gearcache/store/remote.py.

    gearcache push --remote URL            a build machine uploads every valid entry of its folder (and artifacts)
    gearcache pull --remote URL            a node fetches every remote entry and artifact (checked) before serving
    gearcache ls --remote URL              one row per remote entry: method, topology, entry, artifact, size
    gearcache inspect ENTRY --remote URL   the remote entry manifest and its artifact's head
    gearcache verify --remote URL          every remote artifact unpacked in a temp folder and checked (digests,
                                           signature); every entry's signature and artifact; exit 1 on a problem
    gearcache stats --remote URL           entries, artifacts, bytes, server memory
    gearcache prune --remote URL [--corrupt] [--all] [--yes]
                                           delete corrupt or dangling entries/artifacts and orphan chunks (or all)

The signing key comes from ``$GEARCACHE_SIGNING_KEY``; without one, ``--remote-trust unsigned-ok`` is needed.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .cli import FAILED, OK, USAGE, CliError, _emit, fmt_bytes, format_table
from .errors import CacheCorruptionError, ConfigError
from .store import Store
from .store.backend import RemoteError
from .store.remote import REMOTE_ENV, checked_files

REMOTE_COMMANDS = ("ls", "inspect", "verify", "stats", "prune")


def add_arguments(common: argparse.ArgumentParser) -> None:
    common.add_argument("--remote", metavar="URL", help=f"a remote store, e.g. redis://host:6379/0 (default: "
                                                        f"${REMOTE_ENV} for push/pull)")
    common.add_argument("--remote-trust", choices=("signed", "unsigned-ok"), default="signed",
                        help="'unsigned-ok': use the remote without $GEARCACHE_SIGNING_KEY (anyone who can write "
                             "the server can then run code on the nodes)")


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("push", parents=[common], help="upload the folder's entries to the remote store",
                       description="Upload every valid entry of the cache folder and its artifact (skipped when the "
                                   "remote has it, unless --force) to the remote store: a build machine's step.")
    p.add_argument("--force", action="store_true", help="upload artifacts the remote already holds")
    p.set_defaults(func=cmd_push)
    p = sub.add_parser("pull", parents=[common], help="fetch the remote store's entries into the folder",
                       description="Fetch every remote entry (of --method) and its artifact into the cache folder, "
                                   "checked (digests, signature) as a miss would be: a node's step before serving.")
    p.add_argument("--method", metavar="NAME", help="only this method's entries")
    p.set_defaults(func=cmd_pull)


def store_for(args: argparse.Namespace) -> Store:
    url = args.remote or os.environ.get(REMOTE_ENV)
    if not url:
        raise CliError(f"gearcache {args.command}: no remote store. Fix: pass --remote redis://host:6379/0 or set "
                       f"${REMOTE_ENV}")
    try:
        store = Store(args.cache_dir, remote=url, remote_trust=args.remote_trust)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    return store


def _remote_call(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except RemoteError as exc:
        raise CliError(str(exc), FAILED) from None


def cmd_push(args: argparse.Namespace) -> int:
    store = store_for(args)
    if not (store.root / "entries").is_dir():
        raise CliError(f"no cache folder at {store.root}")
    done = _remote_call(store.push_to_remote, force=args.force)
    _emit(args, {"remote": store.remote.url, "cache_dir": str(store.root), **done},
          lambda: f"pushed {done['entries']} entries and {done['artifacts']} artifacts from {store.root} to "
                  f"{store.remote.url}" + (f"; skipped {done['skipped']} invalid" if done["skipped"] else ""))
    return FAILED if done["skipped"] else OK


def cmd_pull(args: argparse.Namespace) -> int:
    store = store_for(args)
    done = _remote_call(store.pull_from_remote, method=args.method)
    _emit(args, {"remote": store.remote.url, "cache_dir": str(store.root), **done},
          lambda: f"pulled {done['entries']} entries and {done['artifacts']} artifacts from {store.remote.url} into "
                  f"{store.root}" + (f"; refused {done['refused']} (see the log)" if done["refused"] else ""))
    return FAILED if done["refused"] else OK


def dispatch(args: argparse.Namespace) -> int:
    """``ls``/``inspect``/``verify``/``stats``/``prune`` against ``--remote``."""
    store = store_for(args)
    return _remote_call({"ls": _ls, "inspect": _inspect, "verify": _verify, "stats": _stats,
                         "prune": _prune}[args.command], args, store)


def _entries(store: Store) -> list[dict[str, Any]]:
    remote, rows = store.remote, []
    for topology, method, ekey in sorted(remote.entries()):
        raw = remote.backend.get(remote.entry_key(topology, method, ekey))
        try:
            data = json.loads(raw) if raw is not None else {}
        except ValueError:
            data = {}
        rows.append({"method": method, "topology": topology, "ekey": ekey, "akey": data.get("akey"),
                     "created": data.get("created"), "manifest": data})
    return rows


def _head(store: Store, akey: str | None) -> dict[str, Any] | None:
    if not akey:
        return None
    raw = store.remote.backend.get(store.remote.head_key(akey))
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return {"unreadable": True}


def _ls(args: argparse.Namespace, store: Store) -> int:
    rows = []
    for r in _entries(store):
        head = _head(store, r["akey"]) or {}
        rows.append({k: v for k, v in r.items() if k != "manifest"} | {"bytes": head.get("bytes")})
    _emit(args, {"remote": store.remote.url, "entries": rows}, lambda: (format_table(
        ["METHOD", "TOPOLOGY", "ENTRY", "ARTIFACT", "SIZE"],
        [[r["method"], r["topology"], r["ekey"][:12], (r["akey"] or "?")[:12], fmt_bytes(r["bytes"])]
         for r in rows], right=(4,)) + "\n" if rows else "") + f"{len(rows)} entries in {store.remote.url}")
    return OK


def _inspect(args: argparse.Namespace, store: Store) -> int:
    found = [r for r in _entries(store) if r["ekey"].startswith(args.entry)]
    if len(found) != 1:
        raise CliError(f"entry {args.entry!r}: {'no' if not found else len(found)} remote entries match")
    r = found[0]
    head = _head(store, r["akey"])
    doc = {"remote": store.remote.url, **r, "artifact_head": head and {k: v for k, v in head.items()
                                                                        if k != "manifest"}}
    _emit(args, doc, lambda: json.dumps(doc, indent=2, default=repr))
    return OK


def check_artifact(store: Store, akey: str) -> str:
    """'ok', or why the remote artifact ``akey`` is not loadable (checked in memory as a fetch checks it)."""
    parts = store.remote._read_bundle(akey)
    if parts is None:
        return "missing, incomplete or unreadable (see the log)"
    try:
        checked_files(store, akey, *parts)
        return "ok"
    except (CacheCorruptionError, ValueError) as exc:
        return getattr(exc, "reason", None) or str(exc)


def _verify(args: argparse.Namespace, store: Store) -> int:
    problems: list[dict[str, str]] = []
    artifacts = {a: check_artifact(store, a) for a in store.remote.artifacts()}
    for r in _entries(store):
        why = store.remote._signature_problem(r["manifest"]) if r["manifest"] else "unreadable"
        if not why:
            why = "" if artifacts.get(r["akey"]) == "ok" else f"artifact {r['akey']}: " + artifacts.get(
                r["akey"], "missing")
        if why:
            problems.append({"ekey": r["ekey"], "problem": why})
    problems += [{"akey": a, "problem": why} for a, why in artifacts.items() if why != "ok"]
    ok = sum(1 for w in artifacts.values() if w == "ok")
    _emit(args, {"remote": store.remote.url, "artifacts_ok": ok, "problems": problems},
          lambda: "\n".join([f"{p.get('ekey') or p.get('akey')}: {p['problem']}" for p in problems] +
                            [f"{ok} artifacts ok, {len(problems)} problems in {store.remote.url}"]))
    return FAILED if problems else OK


def _stats(args: argparse.Namespace, store: Store) -> int:
    entries, artifacts = _entries(store), store.remote.artifacts()
    total = sum((_head(store, a) or {}).get("bytes") or 0 for a in artifacts)
    server = store.remote.backend.describe()
    doc = {"remote": store.remote.url, "entries": len(entries), "artifacts": len(artifacts), "total_bytes": total,
           "server": server}
    _emit(args, doc, lambda: format_table(["", ""], [
        ["entries", len(entries)], ["artifacts", len(artifacts)], ["artifact bytes", fmt_bytes(total)],
        *[[k, v] for k, v in server.items()]]).split("\n", 1)[1])
    return OK


def _prune(args: argparse.Namespace, store: Store) -> int:
    remote = store.remote
    if not (args.corrupt or getattr(args, "all", False)):
        raise CliError("prune --remote: say what to delete: --corrupt (corrupt or dangling entries and artifacts, "
                       "orphan chunks) or --all", USAGE)
    gone: list[str] = []
    if args.all:
        gone = list(remote.backend.scan(remote.prefix))
    else:
        bad = {a for a in remote.artifacts() if check_artifact(store, a) != "ok"}
        gone += [remote.head_key(a) for a in bad]
        for r in _entries(store):
            if not r["manifest"] or r["akey"] in bad or _head(store, r["akey"]) is None:
                gone.append(remote.entry_key(r["topology"], r["method"], r["ekey"]))
        live = {remote.chunk_keys(a, h["bundle"], 1)[0].rsplit(":", 1)[0] for a in remote.artifacts() if a not in bad
                for h in [_head(store, a)] if h and "bundle" in h}
        gone += [k for k in remote.backend.scan(f"{remote.prefix}chunk:") if k.rsplit(":", 1)[0] not in live]
    if args.yes:
        remote.backend.delete(gone)
    _emit(args, {"remote": remote.url, "deleted" if args.yes else "would_delete": gone},
          lambda: "\n".join(gone + [f"{'deleted' if args.yes else 'would delete (dry run; --yes deletes)'} "
                                    f"{len(gone)} keys in {remote.url}"]))
    return OK
