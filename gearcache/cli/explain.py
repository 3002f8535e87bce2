"""``gearcache explain``: the key factors two entries differ in, or why a method's latest recorded miss missed.

Misses are recorded and read back by gearcache/store/diagnostics.py (the key factors of each miss that compiled);
entries are
read through the store (folder.py).
"""
from __future__ import annotations

import argparse
from typing import Any

from ..store.diagnostics import differing_factors, missed_methods, nearest_entry, recorded_misses
from ..errors import CliError
from .folder import EntryRef, StoreView, open_view
from .local import ordered_factors
from .output import FAILED, OK, compact, emit, fmt_time, format_table, iso_time, short_signature



def cmd_explain(args: argparse.Namespace) -> int:
    if args.method and args.entries:
        raise CliError("explain takes either two entries or --method NAME, not both")
    if args.method:
        return explain_miss(args)
    if len(args.entries) != 2:
        raise CliError("explain needs two entries (ENTRY_A ENTRY_B) or --method NAME")
    view = open_view(args)
    a, b = (view.resolve(name)[0] for name in args.entries)
    fa, fb = (a.manifest or {}).get("factors", {}), (b.manifest or {}).get("factors", {})
    diffs = diff_doc(fa.get("hashes", {}), fa.get("values", {}), fb.get("hashes", {}), fb.get("values", {}))
    doc = {"a": {"ekey": a.ekey, "method": a.method, "topology": a.topology},
           "b": {"ekey": b.ekey, "method": b.method, "topology": b.topology},
           "differs": diffs, "same": not diffs}

    def human() -> str:
        head = f"A = {a.ekey} ({a.method})\nB = {b.ekey} ({b.method})"
        if not diffs:
            return f"{head}\nthe two entries have the same key factors"
        return (f"{head}\n{len(diffs)} key factor(s) differ: {', '.join(d['factor'] for d in diffs)}\n\n"
                f"{diff_table(diffs, 'A', 'B')}")

    emit(args, doc, human)
    return FAILED if diffs else OK


def value_diffs(name: str, a: Any, b: Any) -> list[tuple[str, str, str]]:
    """Human lines ``(what, value in A, value in B)`` for a differing factor: sub-keys for dicts, items for lists."""
    if name == "signature" and isinstance(a, dict) and isinstance(b, dict):
        sa, sb = short_signature(a), short_signature(b)
        if sa != sb:
            return [(name, sa, sb)]
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
        return [(f"{name}.{k}", compact(a.get(k, "(absent)")), compact(b.get(k, "(absent)"))) for k in keys]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [(f"{name}[{i}]", compact(x), compact(y)) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return [(name, compact(a), compact(b))]


def diff_doc(hashes_a: dict[str, str], values_a: dict[str, Any], hashes_b: dict[str, str],
             values_b: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"factor": n, "hash_a": hashes_a.get(n), "hash_b": hashes_b.get(n),
             "value_a": values_a.get(n), "value_b": values_b.get(n)}
            for n in ordered_factors(differing_factors(hashes_a, hashes_b))]


def diff_table(diffs: list[dict[str, Any]], label_a: str, label_b: str) -> str:
    rows = []
    for d in diffs:
        for what, va, vb in value_diffs(d["factor"], d["value_a"], d["value_b"]):
            rows.append([what, compact(va, 70), compact(vb, 70)])
    return format_table(["FACTOR", label_a, label_b], rows)


# ------------------------------------------------------------------------------------------------------ a miss
def explain_miss(args: argparse.Namespace) -> int:
    """The latest recorded miss of the method that is still a miss (no entry of its key on disk), against the nearest
    entry: exit 1. When every recorded miss has compiled since: the latest one, what it compiled to and why it
    missed then: exit 0."""
    view = open_view(args)
    method = resolve_method(view, args.method)
    records = recorded_misses(view.store.layout, method)
    if not records:
        emit(args, {"method": method, "miss": None, "differs": []},
             lambda: f"no recorded miss of {method} in {view.root} (misses are recorded when gearcache compiles an "
                     f"entry)")
        return OK
    entries: dict[tuple[str, Any], EntryRef] = {(r.topology, r.ekey): r for r in view.good_entries()
                                                if r.method == method}
    missing = [r for r in records if (r[2].get("topology") or r[1].parent.parent.name, r[2].get("ekey")) not in
               entries]
    when, path, miss = max(missing or records, key=lambda r: r[0])
    topology = miss.get("topology") or path.parent.parent.name
    compiled = entries.get((topology, miss.get("ekey")))
    doc: dict[str, Any] = {
        "method": method, "topology": topology,
        "miss": {"ekey": miss.get("ekey"), "time": when, "time_iso": iso_time(when), "record": str(path),
                 "signature": short_signature(miss["factors"].get("values", {}).get("signature")),
                 "compiled_as_entry": compiled is not None}}
    head = (f"latest miss of {method} ({topology}) at {fmt_time(when)}: entry {miss.get('ekey')}\n"
            f"  call signature: {doc['miss']['signature']}")
    if compiled is not None:
        return _explain_compiled(args, doc, head, miss, compiled)
    return _explain_still_missing(args, view, doc, head, miss)


def _explain_compiled(args: argparse.Namespace, doc: dict[str, Any], head: str, miss: dict[str, Any],
                      entry: EntryRef) -> int:
    """Every recorded miss compiled since: say what the latest one compiled to (and why it missed then); exit 0."""
    m = entry.manifest or {}
    doc.update(compiled_to={"ekey": entry.ekey, "akey": entry.akey, "created": m.get("created")},
               nearest=None, differs=[], missed_before=miss.get("nearest"),
               missed_because=list(miss.get("differs") or []))

    def human() -> str:
        why = (f"it missed because key factor(s) {', '.join(doc['missed_because'])} differed from entry "
               f"{doc['missed_before']}" if doc["missed_because"] else "it was the method's first compile")
        return (f"{head}\nhas since compiled: entry {entry.ekey} (artifact {entry.akey}, created "
                f"{fmt_time(m.get('created'))}); {why}. No recorded miss of the method is still a miss.")

    emit(args, doc, human)
    return OK


def _explain_still_missing(args: argparse.Namespace, view: StoreView, doc: dict[str, Any], head: str,
                           miss: dict[str, Any]) -> int:
    """The miss has no entry on disk: the key factors it differs in from the nearest entry of the method; exit 1."""
    topology, method = doc["topology"], doc["method"]
    hashes, values = miss["factors"].get("hashes", {}), miss["factors"].get("values", {})
    candidates = [r.manifest for r in view.good_entries() if r.method == method and r.topology == topology
                  and r.manifest is not None]
    nearest, _ = nearest_entry(candidates, hashes, exclude=miss.get("ekey"))
    diffs = []
    if nearest is not None:
        nf = nearest.get("factors", {})
        diffs = diff_doc(hashes, values, nf.get("hashes", {}), nf.get("values", {}))
    doc.update(compiled_to=None, nearest=nearest.get("ekey") if nearest else None, differs=diffs)

    def human() -> str:
        top = f"{head}\nstill a miss: no entry of this key is on disk"
        if nearest is None:
            return f"{top}\nno other entry of {method} to compare with"
        return (f"{top}\nnearest entry: {nearest['ekey']} ({short_signature(nearest.get('signature'))})\n"
                f"{len(diffs)} key factor(s) differ: {', '.join(d['factor'] for d in diffs)}\n\n"
                f"{diff_table(diffs, 'MISS', 'NEAREST ENTRY')}")

    emit(args, doc, human)
    return FAILED


def resolve_method(view: StoreView, name: str) -> str:
    """An exact method name, or the one known method name that ends with ``name`` (``Model.forward``)."""
    known = {r.method for r in view.entries()} | missed_methods(view.store.layout)
    if name in known:
        return name
    matches = sorted(k for k in known if k.endswith("." + name) or k.endswith(name))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CliError(f"no method {name!r} in {view.root}; known: {', '.join(sorted(known)) or '(none)'}")
    raise CliError(f"method {name!r} is ambiguous: {', '.join(matches)}")
