"""The fleet commands of ``gearcache``: ``push``, ``pull``, and ``ls``/``inspect``/``verify``/``stats``/``prune`` with
``--remote URL`` (else ``$GEARCACHE_REMOTE``), through the store's remote tier (gearcache/store/remote.py holds its
layout and its checks).

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
from typing import Any, Callable, TypeVar

from ..errors import CliError, ConfigError, RemoteError
from ..store import Store, StoreConfig
from ..store.remote import REMOTE_ENV, RemoteStore
from .output import FAILED, OK, USAGE, emit, fmt_bytes, format_pairs, format_table

REMOTE_COMMANDS = ("ls", "inspect", "verify", "stats", "prune")
T = TypeVar("T")


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


def store_for(args: argparse.Namespace) -> tuple[Store, RemoteStore]:
    """The local store of ``--cache-dir`` with the remote of ``--remote`` (else ``$GEARCACHE_REMOTE``)."""
    url = args.remote or os.environ.get(REMOTE_ENV)
    if not url:
        raise CliError(f"gearcache {args.command}: no remote store. Fix: pass --remote redis://host:6379/0 or set "
                       f"${REMOTE_ENV}")
    try:
        store = Store(args.cache_dir, StoreConfig(remote=url, remote_trust=args.remote_trust))
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    assert store.remote is not None           # a URL was given
    return store, store.remote


def _remote_call(fn: Callable[..., T], *a: Any, **kw: Any) -> T:
    try:
        return fn(*a, **kw)
    except RemoteError as exc:
        raise CliError(str(exc), FAILED) from None


def cmd_push(args: argparse.Namespace) -> int:
    store, remote = store_for(args)
    if not store.root.is_dir():
        raise CliError(f"no cache folder at {store.root}")
    done = _remote_call(store.sync.push, force=args.force)
    emit(args, {"remote": remote.shown, "cache_dir": str(store.root), **done},
         lambda: f"pushed {done['entries']} entries and {done['artifacts']} artifacts from {store.root} to "
                 f"{remote.shown}" + (f"; skipped {done['skipped']} invalid" if done["skipped"] else ""))
    return FAILED if done["skipped"] else OK


def cmd_pull(args: argparse.Namespace) -> int:
    store, remote = store_for(args)
    done = _remote_call(store.sync.pull, method=args.method)
    emit(args, {"remote": remote.shown, "cache_dir": str(store.root), **done},
         lambda: f"pulled {done['entries']} entries and {done['artifacts']} artifacts from {remote.shown} into "
                 f"{store.root}" + (f"; refused {done['refused']} (see the log)" if done["refused"] else ""))
    return FAILED if done["refused"] else OK


def dispatch(args: argparse.Namespace) -> int:
    """``ls``/``inspect``/``verify``/``stats``/``prune`` against ``--remote``."""
    store, remote = store_for(args)
    command = {"ls": _ls, "inspect": _inspect, "verify": _verify, "stats": _stats, "prune": _prune}[args.command]
    return _remote_call(command, args, store, remote)


def _entries(remote: RemoteStore) -> list[dict[str, Any]]:
    """Every remote entry: ``{"method", "topology", "ekey", "akey", "created", "manifest"}`` (unchecked)."""
    rows = []
    for topology, method, ekey in sorted(remote.entries()):
        data = remote.entry_manifest(topology, method, ekey) or {}
        rows.append({"method": method, "topology": topology, "ekey": ekey, "akey": data.get("akey"),
                     "created": data.get("created"), "manifest": data})
    return rows


def _head(remote: RemoteStore, akey: str | None) -> dict[str, Any] | None:
    return remote.head(akey) if akey else None


def _ls(args: argparse.Namespace, store: Store, remote: RemoteStore) -> int:
    rows = []
    for r in _entries(remote):
        head = _head(remote, r["akey"]) or {}
        rows.append({k: v for k, v in r.items() if k != "manifest"} | {"bytes": head.get("bytes")})
    emit(args, {"remote": remote.shown, "entries": rows}, lambda: (format_table(
        ["METHOD", "TOPOLOGY", "ENTRY", "ARTIFACT", "SIZE"],
        [[r["method"], r["topology"], r["ekey"][:12], (r["akey"] or "?")[:12], fmt_bytes(r["bytes"])]
         for r in rows], right=(4,)) + "\n" if rows else "") + f"{len(rows)} entries in {remote.shown}")
    return OK


def _inspect(args: argparse.Namespace, store: Store, remote: RemoteStore) -> int:
    found = [r for r in _entries(remote) if r["ekey"].startswith(args.entry)]
    if len(found) != 1:
        raise CliError(f"entry {args.entry!r}: {'no' if not found else len(found)} remote entries match")
    r = found[0]
    head = _head(remote, r["akey"])
    doc = {"remote": remote.shown, **r, "artifact_head": head and {k: v for k, v in head.items() if k != "manifest"}}
    emit(args, doc, lambda: json.dumps(doc, indent=2, default=repr))
    return OK


def check_artifact(store: Store, remote: RemoteStore, akey: str) -> str:
    """'ok', or why the remote artifact ``akey`` is not loadable (checked in memory as a fetch checks it)."""
    return remote.artifact_problem(store.artifacts, akey) or "ok"


def _verify(args: argparse.Namespace, store: Store, remote: RemoteStore) -> int:
    problems: list[dict[str, str]] = []
    artifacts = {a: check_artifact(store, remote, a) for a in remote.artifacts()}
    for r in _entries(remote):
        why = remote.signature_problem(r["manifest"]) if r["manifest"] else "unreadable"
        if not why:
            why = "" if artifacts.get(r["akey"]) == "ok" else f"artifact {r['akey']}: " + artifacts.get(
                r["akey"], "missing")
        if why:
            problems.append({"ekey": r["ekey"], "problem": why})
    problems += [{"akey": a, "problem": why} for a, why in artifacts.items() if why != "ok"]
    ok = sum(1 for w in artifacts.values() if w == "ok")
    emit(args, {"remote": remote.shown, "artifacts_ok": ok, "problems": problems},
         lambda: "\n".join([f"{p.get('ekey') or p.get('akey')}: {p['problem']}" for p in problems] +
                           [f"{ok} artifacts ok, {len(problems)} problems in {remote.shown}"]))
    return FAILED if problems else OK


def _stats(args: argparse.Namespace, store: Store, remote: RemoteStore) -> int:
    entries, artifacts = _entries(remote), remote.artifacts()
    total = sum((_head(remote, a) or {}).get("bytes") or 0 for a in artifacts)
    server = remote.backend.describe()
    doc = {"remote": remote.shown, "entries": len(entries), "artifacts": len(artifacts), "total_bytes": total,
           "server": server}
    emit(args, doc, lambda: format_pairs([
        ["entries", len(entries)], ["artifacts", len(artifacts)], ["artifact bytes", fmt_bytes(total)],
        *[[k, v] for k, v in server.items()]]))
    return OK


def _prune(args: argparse.Namespace, store: Store, remote: RemoteStore) -> int:
    if not (args.corrupt or getattr(args, "all", False)):
        raise CliError("prune --remote: say what to delete: --corrupt (corrupt or dangling entries and artifacts, "
                       "orphan chunks) or --all", USAGE)
    if args.all:
        gone = list(remote.backend.scan(remote.prefix))
    else:
        gone = remote.garbage_keys({a for a in remote.artifacts() if check_artifact(store, remote, a) != "ok"})
    if args.yes:
        remote.backend.delete(gone)
    emit(args, {"remote": remote.shown, "deleted" if args.yes else "would_delete": gone},
         lambda: "\n".join(gone + [f"{'deleted' if args.yes else 'would delete (dry run; --yes deletes)'} "
                                   f"{len(gone)} keys in {remote.shown}"]))
    return OK
