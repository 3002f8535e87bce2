"""``gearcache verify`` and ``prune``: check every entry and artifact as the runtime would, delete what is asked.

``verify`` only reads (it quarantines nothing). ``prune --yes`` asks the store to delete entry manifests first, then
the artifacts no remaining entry references (each under the writers' lock of either ``lock_mode``, skipped if another
process holds it or a live process leases it), then their index rows.
"""
from __future__ import annotations

import argparse
import getpass
import logging
import pathlib
import time
from typing import Any

from ..errors import CliError, GearcacheError, LockTimeoutError
from .folder import EntryRef, StoreView, open_view
from .output import FAILED, OK, emit, fmt_bytes, fmt_time, format_table, indent, plural_entries, warn

log = logging.getLogger("gearcache.cli")
Problem = tuple[str, str]           # (status, detail)


# ======================================================================================================== verify
def _machine() -> tuple[dict[str, str], set[str]]:
    import torch

    from .._torch import versions as torch_versions

    devices = {torch_versions.device_capability("cpu")}
    if torch.cuda.is_available():
        devices |= {torch_versions.device_capability(f"cuda:{i}") for i in range(torch.cuda.device_count())}
    return dict(torch_versions.software_versions()), devices


def incompatibilities(manifest: dict[str, Any], software: dict[str, str], devices: set[str]) -> list[str]:
    values = manifest.get("factors", {}).get("values", {})
    out = []
    theirs = values.get("software") or {}
    for k in sorted(set(theirs) | set(software)):
        if theirs.get(k) != software.get(k):
            out.append(f"{k} {theirs.get(k, '(absent)')} (entry) vs {software.get(k, '(absent)')} (here)")
    for d in values.get("devices") or []:
        if d not in devices:
            out.append(f"device {d} is not on this machine ({', '.join(sorted(devices))})")
    return out


def _artifact_status(view: StoreView, akey: str, memo: dict[str, Problem]) -> Problem:
    """("ok" | "corrupt" | "orphaned", detail) for an artifact; verified once."""
    if akey not in memo:
        try:
            view.store.artifacts.verify(akey)
            memo[akey] = ("ok", "")
        except FileNotFoundError:
            memo[akey] = ("orphaned", f"artifact {akey} is missing")
        except (GearcacheError, OSError) as exc:
            memo[akey] = ("corrupt", str(exc))
    return memo[akey]


def _trust_fix(path: pathlib.Path, why: str) -> str:
    if "owned by" in why:
        return (f"`chown -R {getpass.getuser()} {path}` (the serving user must own the store), or use a private "
                f"cache_dir")
    return f"`chmod go-w {path}`"


def untrusted_folders(view: StoreView) -> list[dict[str, str]]:
    """The store's folders the runtime refuses (gearcache/store/trust.py): another user owns them or others can
    write them. A refused root, ``entries/`` or ``artifacts/`` refuses the whole store. ``[{"path", "why", "fix"}]``."""
    return [{"path": str(path), "why": why, "fix": _trust_fix(path, why)}
            for path, why in view.store.trust.refused_folders()]


def _untrusted_entry(view: StoreView, ref: EntryRef) -> Problem | None:
    """("untrusted", why and fix) when the runtime refuses this entry manifest or its method folder."""
    for path in (ref.path.parent, ref.path):
        why = view.store.trust.path_problem(path)
        if why is not None:
            return ("untrusted", f"{path}: {why}; the entry is never loaded. Fix: {_trust_fix(path, why)}")
    return None


def check_entries(view: StoreView) -> tuple[list[dict[str, Any]], dict[str, Problem]]:
    """Per entry: its problems ``[(status, detail)]``, in order corrupt, orphaned, untrusted, incompatible. Also
    the artifacts' statuses."""
    software, devices = _machine()
    memo: dict[str, Problem] = {}
    results = []
    for ref in view.entries():
        problems: list[Problem] = []
        untrusted = _untrusted_entry(view, ref)
        if ref.manifest is None or ref.akey is None:
            problems.append(ref.problem or ("corrupt", "entry manifest unreadable"))
        else:
            status, detail = _artifact_status(view, ref.akey, memo)
            if status != "ok":
                problems.append((status, detail))
            problems += [untrusted] if untrusted else []
            problems += [("incompatible", why) for why in incompatibilities(ref.manifest, software, devices)]
        results.append({"ref": ref, "problems": problems})
    for akey in view.artifact_keys():
        _artifact_status(view, akey, memo)
    return results, memo


def cmd_verify(args: argparse.Namespace) -> int:
    view = open_view(args)
    results, artifacts = check_entries(view)
    referenced = {r["ref"].akey for r in results if r["ref"].akey}
    rows = [{"ekey": r["ref"].ekey, "method": r["ref"].method, "topology": r["ref"].topology, "akey": r["ref"].akey,
             "status": r["problems"][0][0] if r["problems"] else "ok",
             "problems": [{"status": s, "detail": d} for s, d in r["problems"]]} for r in results]
    loose = [{"akey": k, "status": "corrupt" if s == "corrupt" else "unreferenced", "detail": d}
             for k, (s, d) in artifacts.items() if k not in referenced]
    summary: dict[str, int] = {}
    for row in rows:
        summary[row["status"]] = summary.get(row["status"], 0) + 1
    refused = untrusted_folders(view)
    failed = (any(r["status"] != "ok" for r in rows) or any(a["status"] == "corrupt" for a in loose)
              or bool(refused))
    doc = {"cache_dir": str(view.root), "ok": not failed, "summary": summary, "entries": rows,
           "unreferenced_artifacts": loose, "untrusted_folders": refused}
    emit(args, doc, lambda: verify_text(doc))
    return FAILED if failed else OK


def verify_text(doc: dict[str, Any]) -> str:
    """``verify``'s human output of its document."""
    out, rows, loose, refused = [], doc["entries"], doc["unreferenced_artifacts"], doc["untrusted_folders"]
    if refused:
        out += ["REFUSED: gearcache loads nothing from this store and writes nothing to it (every call compiles, "
                "in memory only):"]
        out += [f"  {f['path']}: {f['why']}. Fix: {f['fix']}" for f in refused] + [""]
    if rows:
        out.append(format_table(["STATUS", "METHOD", "ENTRY", "ARTIFACT", "DETAIL"], [
            [r["status"], r["method"], r["ekey"][:12], (r["akey"] or "-")[:12],
             "; ".join(p["detail"] for p in r["problems"]) or ""] for r in rows]))
    else:
        out.append(f"no entries in {doc['cache_dir']}")
    if loose:
        out += ["", "artifacts no entry references:", indent(format_table(
            ["STATUS", "ARTIFACT", "DETAIL"], [[a["status"], a["akey"], a["detail"]] for a in loose]))]
    counts = ", ".join(f"{n} {s}" for s, n in sorted(doc["summary"].items())) or "0 entries"
    out += ["", f"{counts}: {'all ok' if doc['ok'] else 'PROBLEMS FOUND'}"]
    return "\n".join(out)


# ========================================================================================================= prune
def parse_size(text: str) -> int:
    """``"1000"``, ``"500K"``, ``"2M"``, ``"1.5G"`` (powers of 1024; an optional trailing ``B`` / ``iB``)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(raw[-1:], 1)
    number = raw[:-1] if scale != 1 else raw
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1000000, 500M, 2G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size cannot be negative")
    return int(value * scale)


def non_negative_days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of days >= 0")
    return value


Chosen = dict[str, dict[str, Any]]      # path of each selected entry manifest -> {"ref", "reasons"}


def _pick(chosen: Chosen, ref: EntryRef, reason: str) -> None:
    chosen.setdefault(str(ref.path), {"ref": ref, "reasons": []})["reasons"].append(reason)


def select_for_prune(view: StoreView, args: argparse.Namespace) -> Chosen:
    """The entries ``prune``'s options select, each with the reasons."""
    chosen: Chosen = {}
    if args.corrupt or args.incompatible:
        results, _ = check_entries(view)
        for r in results:
            for status, detail in r["problems"]:
                if (status in ("corrupt", "orphaned") and args.corrupt) or (status == "incompatible" and
                                                                            args.incompatible):
                    _pick(chosen, r["ref"], f"{status}: {detail}")
                    break
    if args.older_than is not None:
        cutoff = time.time() - args.older_than * 86400
        for ref in view.entries():
            used = view.last_used(ref) if ref.manifest is not None else None
            if used is not None and used < cutoff:
                _pick(chosen, ref, f"last used {fmt_time(used)}, more than {args.older_than:g} days ago")
    if args.max_size is not None:
        _select_over_size(view, chosen, args.max_size)
    return chosen


def _select_over_size(view: StoreView, chosen: Chosen, max_size: int) -> None:
    """Pick least recently used entries until the artifacts the others reference total at most ``max_size``."""
    refs: dict[str, int] = {}
    kept = [r for r in view.good_entries() if str(r.path) not in chosen and r.akey]
    for ref in kept:
        refs[ref.akey or ""] = refs.get(ref.akey or "", 0) + 1
    total = sum(view.artifact_bytes(k) or 0 for k in view.artifact_keys() if k in refs)
    for ref in sorted(kept, key=lambda r: view.last_used(r) or 0.0):
        if total <= max_size:
            break
        _pick(chosen, ref, f"least recently used ({fmt_time(view.last_used(ref))}) while the artifacts exceed "
                           f"{fmt_bytes(max_size)}")
        refs[ref.akey or ""] -= 1
        if refs[ref.akey or ""] == 0:
            total -= view.artifact_bytes(ref.akey) or 0


def cmd_prune(args: argparse.Namespace) -> int:
    if args.older_than is None and args.max_size is None and not args.incompatible and not args.corrupt:
        raise CliError("prune needs at least one of --older-than DAYS, --max-size BYTES, --incompatible, --corrupt")
    view = open_view(args)
    chosen = select_for_prune(view, args)
    doomed = {str(c["ref"].path) for c in chosen.values()}
    remaining = {r.akey for r in view.entries() if str(r.path) not in doomed and r.akey}
    artifacts = sorted({c["ref"].akey for c in chosen.values() if c["ref"].akey} - remaining)
    artifacts = [k for k in artifacts if view.store.layout.artifact(k).is_dir()]
    entry_rows = [{"ekey": c["ref"].ekey, "method": c["ref"].method, "topology": c["ref"].topology,
                   "akey": c["ref"].akey, "path": str(c["ref"].path), "reasons": c["reasons"]}
                  for c in chosen.values()]
    art_rows = [{"akey": k, "bytes": view.artifact_bytes(k)} for k in artifacts]
    deleted_arts: list[str] = []
    locked: list[str] = []
    if args.yes:
        deleted_arts, locked = _delete(view, chosen, artifacts)
    freed = sum(a["bytes"] or 0 for a in art_rows if not args.yes or a["akey"] in deleted_arts)
    doc = {"cache_dir": str(view.root), "dry_run": not args.yes, "entries": entry_rows, "artifacts": art_rows,
           "deleted_artifacts": deleted_arts, "skipped_locked": locked, "bytes_freed": freed}
    emit(args, doc, lambda: prune_text(doc))
    return OK


def prune_text(doc: dict[str, Any]) -> str:
    """``prune``'s human output of its document."""
    entry_rows, art_rows, dry = doc["entries"], doc["artifacts"], doc["dry_run"]
    if not entry_rows:
        return "nothing to prune"
    verb = "would delete" if dry else "deleted"
    out = [f"{verb} {plural_entries(len(entry_rows))}:", indent(format_table(
        ["METHOD", "ENTRY", "ARTIFACT", "REASON"],
        [[r["method"], r["ekey"][:12], (r["akey"] or "-")[:12], "; ".join(r["reasons"])] for r in entry_rows]))]
    if art_rows:
        out += [f"{verb} {len(art_rows) if dry else len(doc['deleted_artifacts'])} artifact(s), "
                f"{fmt_bytes(doc['bytes_freed'])}:"]
        skipped = "  (skipped: locked or in use by a running process)"
        out += [f"  {a['akey']}  {fmt_bytes(a['bytes'])}{skipped if a['akey'] in doc['skipped_locked'] else ''}"
                for a in art_rows]
    if dry:
        out += ["dry run: nothing was deleted; pass --yes to delete"]
    return "\n".join(out)


def _delete(view: StoreView, chosen: Chosen, artifacts: list[str]) -> tuple[list[str], list[str]]:
    """Delete entry manifests, then the artifacts no remaining entry references (under their locks; an artifact a
    live process has a lease on stays), then index rows. Returns (deleted artifact keys, artifact keys skipped because
    a running process holds their lock or uses them)."""
    store = view.store
    for c in chosen.values():
        ref = c["ref"]
        store.entries.remove(ref.topology, ref.method, ref.ekey)
        log.info("%s: pruned entry %s: %s", ref.method, ref.ekey, "; ".join(c["reasons"]))
    still_used = {r.akey for r in view.entries(refresh=True) if r.akey}
    deleted, locked = [], []
    for akey in artifacts:
        if akey in still_used:
            continue                # an entry written meanwhile uses it again
        try:                        # the writers' own lock, of either lock_mode (flock or soft)
            with store.locks.held_in_every_mode(akey, 0):
                status = store.maintenance.remove_artifact(akey)      # moved aside at once: never seen half deleted
        except LockTimeoutError:
            locked.append(akey)
            warn(f"artifact {akey} is locked by a running process; left in place")
            continue
        if status == "removed":
            deleted.append(akey)
            log.info("pruned artifact %s", akey)
        elif status != "gone":
            locked.append(akey)
            warn(f"artifact {akey} is {status}; left in place")
    kept = {r.ekey for r in view.entries()}
    store.index.forget([c["ref"].ekey for c in chosen.values() if c["ref"].ekey not in kept], deleted)
    return deleted, locked

