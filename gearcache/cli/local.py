"""``gearcache ls``, ``inspect`` and ``stats``: what a cache folder holds, read through its store (folder.py)."""
from __future__ import annotations

import argparse
from typing import Any, Iterable

from ..keys.key import ENTRY_FACTORS
from .folder import EntryRef, StoreView, open_view
from .output import (OK, compact, emit, fmt_bytes, fmt_gears, fmt_time, format_pairs, format_table, indent,
                     plural_entries, short_signature, warn)

FACTOR_ORDER = list(ENTRY_FACTORS)


def ordered_factors(names: Iterable[str]) -> list[str]:
    """Factor names in key order (the order the entry key hashes them), unknown ones last."""
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (FACTOR_ORDER.index(n) if n in FACTOR_ORDER else len(FACTOR_ORDER), n))


# ============================================================================================================ ls
def cmd_ls(args: argparse.Namespace) -> int:
    view = open_view(args)
    rows = []
    gears_memo: dict[tuple[str, str], list[Any]] = {}
    for ref in view.entries():
        if ref.manifest is None:
            warn(f"skipping {ref.path}: {ref.problem[1] if ref.problem else 'unreadable'}")
            continue
        m, row = ref.manifest, view.usage(ref.ekey)
        key = (ref.topology, ref.method)
        if key not in gears_memo:
            gears_memo[key] = view.gears(*key)
        rows.append({
            "method": ref.method, "topology": ref.topology, "ekey": ref.ekey,
            "signature": short_signature(m.get("signature")), "gears": gears_memo[key], "akey": ref.akey,
            "bytes": view.artifact_bytes(ref.akey), "created": m.get("created"),
            "last_used": row.get("last_used"), "loads": row.get("loads", 0), "hits": row.get("hits", 0),
            "compile_seconds": m.get("compile_seconds"),
        })
    rows.sort(key=lambda r: (r["method"], r["topology"], r["created"] or 0))

    def human() -> str:
        if not rows:
            return f"no entries in {view.root}"
        table = format_table(
            ["METHOD", "TOPOLOGY", "ENTRY", "SIGNATURE", "GEARS", "SIZE", "LAST USED", "LOADS", "HITS"],
            [[r["method"], r["topology"], r["ekey"][:12], r["signature"], fmt_gears(r["gears"]),
              fmt_bytes(r["bytes"]), fmt_time(r["last_used"]), r["loads"], r["hits"]] for r in rows],
            right=(5, 7, 8))
        return f"{table}\n{plural_entries(len(rows))} in {view.root}"

    emit(args, {"cache_dir": str(view.root), "entries": rows}, human)
    return OK


# ======================================================================================================= inspect
def cmd_inspect(args: argparse.Namespace) -> int:
    view = open_view(args)
    refs = view.resolve(args.entry)
    doc = inspect_doc(view, refs)
    emit(args, doc, lambda: inspect_text(doc, refs[0].manifest or {}))
    return OK


def inspect_doc(view: StoreView, refs: list[EntryRef]) -> dict[str, Any]:
    """``inspect``'s document for an entry (``refs``: its manifest in each topology that holds it)."""
    ref = refs[0]
    m = ref.manifest or {}
    akey = m["akey"]
    folder, compiled = view.store.layout.artifact(akey), view.store.layout.torch_artifact(akey)
    values, hashes = m.get("factors", {}).get("values", {}), m.get("factors", {}).get("hashes", {})
    factors = [{"name": n, "hash": hashes.get(n), "value": values.get(n)}
               for n in ordered_factors([*hashes, *values])]
    code = sorted(str(p) for p in compiled.rglob("*.py")) if folder.is_dir() else []
    kernels = sorted(str(p) for p in compiled.rglob("*")
                     if p.suffix in (".so", ".cubin", ".hsaco", ".ptx")) if folder.is_dir() else []
    return {
        "ekey": ref.ekey, "method": ref.method, "topology": ref.topology,
        "also_in_topologies": [r.topology for r in refs[1:]], "manifest": str(ref.path),
        "signature": m.get("signature"), "signature_short": short_signature(m.get("signature")),
        "created": m.get("created"), "compile_seconds": m.get("compile_seconds"),
        "factors": factors, "akey": akey, "artifact_dir": str(folder), "artifact_exists": folder.is_dir(),
        "artifact_bytes": view.artifact_bytes(akey), "artifact_factors": m.get("artifact_factors"),
        "generated_code": code, "kernels": kernels,
        "inputs": m.get("inputs"), "outputs": m.get("outputs"), "dependencies": _dependencies(m),
        "index": view.usage(ref.ekey), "run_plan": run_plan_status(folder), "value_guards": m.get("guards", []),
    }


def inspect_text(doc: dict[str, Any], m: dict[str, Any]) -> str:
    """``inspect``'s human output of ``doc`` (:func:`inspect_doc`) for the entry manifest ``m``."""
    row, akey = doc["index"], doc["akey"]
    out = [format_pairs([
        ["entry", doc["ekey"]], ["method", doc["method"]],
        ["topology", ", ".join([doc["topology"]] + doc["also_in_topologies"])], ["manifest", doc["manifest"]],
        ["signature", doc["signature_short"]], ["created", fmt_time(m.get("created"))],
        ["compile", f"{m.get('compile_seconds') or 0:.2f} s"],
        ["loads / hits", f"{row.get('loads', 0)} / {row.get('hits', 0)}"],
        ["last used", fmt_time(row.get("last_used"))], ["run plan", doc["run_plan"]],
    ])]
    out += ["", "key factors:", indent(format_table(
        ["FACTOR", "HASH", "VALUE"],
        [[f["name"], (f["hash"] or "-")[:16],
          short_signature(f["value"]) if f["name"] == "signature" else compact(f["value"], 90)]
         for f in doc["factors"]]))]
    state = "" if doc["artifact_exists"] else "  (MISSING)"
    out += ["", f"artifact {akey}{state}", f"  folder: {doc['artifact_dir']}",
            f"  size:   {fmt_bytes(doc['artifact_bytes'])}"]
    out += ["", "generated code:"] + [f"  {p}" for p in doc["generated_code"] or ["(none)"]]
    if doc["kernels"]:
        out += ["kernels:"] + [f"  {p}" for p in doc["kernels"]]
    out += ["", "graph inputs (recipe):", indent(format_table(
        ["#", "KIND", "SOURCE"], [[i, k, _describe_input(k, r, m)] for i, (k, r) in enumerate(m.get("inputs", []))],
        right=(0,)))]
    outs = m.get("outputs") or {}
    out += ["", f"graph outputs (recipe): structure {compact(outs.get('structure'), 90)}", indent(format_table(
        ["#", "KIND", "SOURCE"], [[i, k, compact(r, 60)] for i, (k, r) in enumerate(outs.get("leaves", []))],
        right=(0,)))]
    guards = doc["value_guards"]
    out += ["", f"value guards ({len(guards)}: Python values the graph bakes in, checked when the entry is chosen):"]
    out += [f"  {_describe_guard(g)}" for g in guards[:40]] or ["  (none)"]
    if len(guards) > 40:
        out.append(f"  ... {len(guards) - 40} more (--json lists them all)")
    out += ["", "dependencies:"]
    out += [f"  {d.get('file')}:{d.get('first_line')}+{d.get('n_lines')}  {d.get('name')}  "
            f"sha256 {str(d.get('sha256'))[:12]}{'  CHANGED since compile' if d['changed'] else ''}"
            for d in doc["dependencies"]] or ["  (none)"]
    return "\n".join(out)


def run_plan_status(folder: Any) -> str:
    """Whether a warm process loads the artifact in ``folder`` with gearcache's own loader (gearcache/runplan/), and
    if not why."""
    from ..runplan.loader import read_plan

    try:
        plan = read_plan(folder)
    except (OSError, ValueError, AttributeError):
        plan = None
    if plan is None:
        return "none (loads with torch's loader)"
    bound = "" if plan.get("device_free", True) else f"; runs on cuda:{plan.get('device_index')} only"
    if plan.get("supported"):
        return (f"yes: {len(plan.get('triton', {}))} Triton and {len(plan.get('cpp', {}))} C++ kernels, "
                f"torch's compiler not imported{bound}")
    return f"no ({plan.get('reason')}): loads with torch's loader{bound}"


def _dependencies(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The entry's source dependencies, each with ``changed``: whether the file changed since the compile."""
    from ..compiling.capture import dependencies_changed

    deps = []
    for d in m.get("dependencies", []):
        changed = dependencies_changed([d]) if isinstance(d, dict) and "file" in d else "malformed"
        deps.append({**d, "changed": changed is not None})
    return deps


def _describe_guard(record: list[Any]) -> str:
    """One value guard of a manifest, as ``path (kind): expected``."""
    from ..keys.value_guard import ValueGuard

    try:
        guard = ValueGuard.from_json(record)
        return f"{guard.text()} ({guard.kind}): {compact(guard.expected, 60)}"
    except (TypeError, ValueError, KeyError):
        return f"malformed: {compact(record, 80)}"


def _describe_input(kind: str, ref: Any, manifest: dict[str, Any]) -> str:
    if kind == "leaf":
        try:
            leaf = manifest["signature"]["leaves"][int(ref)]
            if "shape" in leaf:
                return f"argument leaf {ref}: {leaf['dtype'].replace('torch.', '')}{leaf['shape']} {leaf['device']}"
            return f"argument leaf {ref}: {leaf.get('type')}={leaf.get('value')}"
        except (KeyError, IndexError, TypeError, ValueError):
            return f"argument leaf {ref}"
    if kind == "state":
        return f"module tensor {ref}"
    return compact(ref, 60)


# ========================================================================================================= stats
def cmd_stats(args: argparse.Namespace) -> int:
    view = open_view(args)
    entries = view.good_entries()
    sizes = view.published()
    rows = [view.usage(e.ekey) for e in {e.ekey: e for e in entries}.values()]

    def total(key: str) -> float:
        return sum(r.get(key, 0) or 0 for r in rows)

    # elements of the geared inputs of served calls: as the entries ran them (padded to a gear), as callers passed them
    padded, real = total("padded_elements"), total("real_elements")
    waste = (1.0 - real / padded) if padded else None
    doc: dict[str, Any] = {
        "cache_dir": str(view.root), "entries": len(entries),
        "methods": len({(e.topology, e.method) for e in entries}),
        "artifacts": len(sizes), "total_bytes": sum(size for size, _ in sizes.values()),
        "loads": int(total("loads")), "hits": int(total("hits")),
        "compile_seconds": round(sum(float((e.manifest or {}).get("compile_seconds") or 0) for e in entries), 6),
        "load_seconds": round(total("load_seconds"), 6), "padding_waste": waste,   # (a run plan's load: < 1 ms)
        "real_elements": int(real), "padded_elements": int(padded),
        "unreadable_entries": len(view.entries()) - len(entries),
    }

    def human() -> str:
        return format_pairs([
            ["cache dir", doc["cache_dir"]], ["entries", doc["entries"]], ["methods", doc["methods"]],
            ["artifacts", doc["artifacts"]],
            ["total size", f"{fmt_bytes(doc['total_bytes'])} ({doc['total_bytes']} bytes)"],
            ["loads", doc["loads"]], ["hits", doc["hits"]], ["compile seconds", f"{doc['compile_seconds']:.2f}"],
            ["load seconds", f"{doc['load_seconds']:.3f}"],
            ["padding waste", "n/a" if waste is None else f"{waste:.1%}"],
        ])

    emit(args, doc, human)
    return OK
