"""``gearcache``: look into a cache folder, check it, explain misses, prune it, warm it up.

    gearcache ls                           one row per entry: method, signature, gears, size, last used, loads, hits
    gearcache inspect ENTRY                an entry's key factors, artifact, generated code, recipes, dependencies
    gearcache explain ENTRY_A ENTRY_B      the key factors two entries differ in, with both values
    gearcache explain --method NAME        why the latest recorded miss of a method that is still a miss missed (vs the
                                           nearest entry), or what the latest miss has compiled to since
    gearcache verify                       artifact digests, compatibility, missing artifacts, modes or owners the
                                           runtime refuses
    gearcache prune --older-than DAYS ...  delete entries (a dry run unless --yes)
    gearcache warmup MODULE:FACTORY        compile or load every gear of a model's cached methods
    gearcache stats                        totals across the folder
    gearcache native [status|build]        gearcache's native checks for this torch (gearcache/native/): where, built?
    gearcache push / pull --remote URL     a fleet's remote store (and ls/inspect/verify/stats/prune --remote URL):
                                           gearcache/cli_remote.py

Every subcommand takes ``--cache-dir`` (default ``$GEARCACHE_HOME``, else ``./.gearcache``) and ``--json`` (one JSON
document on stdout). Exit status: 0 ok; 1 a check failed (verify found problems, explain found a miss that is still a
miss, or two entries that differ); 2 a usage error, a missing cache folder or an unknown entry.

``ls``, ``inspect``, ``explain``, ``verify`` and ``stats`` only read (``verify`` quarantines nothing). ``prune --yes``
deletes entry manifests first, then the artifacts no remaining entry references (each under its lock, skipped if
another process holds it), then their index rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import getpass
import importlib
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any, Callable, Iterable

from .key import ENTRY_FACTORS

OK, FAILED, USAGE = 0, 1, 2
ENTRY_PREFIX_MIN = 6
FACTOR_ORDER = list(ENTRY_FACTORS)

log = logging.getLogger("gearcache.cli")


class CliError(Exception):
    """A message for stderr and the exit status to return."""

    def __init__(self, message: str, code: int = USAGE):
        super().__init__(message)
        self.code = code


# ================================================================================================= the cache folder
@dataclasses.dataclass
class EntryRef:
    """One entry manifest file. ``manifest`` is None when it is unreadable; ``problem`` then says why."""
    topology: str
    method: str
    ekey: str
    path: pathlib.Path
    manifest: dict[str, Any] | None
    problem: tuple[str, str] | None = None        # (status, detail): ("corrupt" | "incompatible", why)

    @property
    def akey(self) -> str | None:
        return self.manifest.get("akey") if self.manifest else None


class Cache:
    """Read-only view of a cache folder (lazily scanned, memoised)."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self._entries: list[EntryRef] | None = None
        self._index: dict[str, Any] | None = None
        self._artifacts: dict[str, dict[str, Any] | None] = {}
        self._store = None

    # ------------------------------------------------------------------------------------------------ entries
    def entries(self, refresh: bool = False) -> list[EntryRef]:
        if self._entries is None or refresh:
            self._entries = list(_scan_entries(self.root))
        return self._entries

    def good_entries(self) -> list[EntryRef]:
        return [e for e in self.entries() if e.manifest is not None]

    def resolve(self, name: str) -> list[EntryRef]:
        """Entries (one per topology holding it) whose key is ``name`` or starts with it."""
        name = name.strip().lower()
        if len(name) < ENTRY_PREFIX_MIN:
            raise CliError(f"entry {name!r}: give an entry key or at least {ENTRY_PREFIX_MIN} of its first "
                           f"characters (see `gearcache ls`)")
        matches = [e for e in self.good_entries() if e.ekey.startswith(name)]
        if not matches:
            raise CliError(f"no entry {name!r} in {self.root} (see `gearcache ls`)")
        keys = sorted({e.ekey for e in matches})
        if len(keys) > 1:
            raise CliError(f"entry {name!r} is ambiguous: it starts {len(keys)} entry keys "
                           f"({', '.join(k[:16] for k in keys[:5])}{', ...' if len(keys) > 5 else ''}); give more "
                           f"characters")
        return matches

    # ---------------------------------------------------------------------------------------------- artifacts
    def artifact_manifest(self, akey: str) -> dict[str, Any] | None:
        if akey not in self._artifacts:
            try:
                data = json.loads((self.root / "artifacts" / akey / "MANIFEST.json").read_text(encoding="utf-8"))
                self._artifacts[akey] = data if isinstance(data, dict) else None
            except (OSError, ValueError):
                self._artifacts[akey] = None
        return self._artifacts[akey]

    def artifact_bytes(self, akey: str) -> int | None:
        m = self.artifact_manifest(akey)
        if m is not None and isinstance(m.get("bytes"), int):
            return m["bytes"]
        folder = self.root / "artifacts" / akey
        if folder.is_dir():
            return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        return None

    def artifact_keys(self) -> list[str]:
        folder = self.root / "artifacts"
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []

    # ------------------------------------------------------------------------------------------------- index
    def index(self) -> dict[str, Any]:
        """The index rows, read once; {} when there is no index (or it cannot be read: warned on stderr)."""
        if self._index is None:
            self._index = {}
            folder = self.root / "index"
            if folder.is_dir():
                try:            # an index SQLite cannot read is moved aside and rebuilt (warned once)
                    index = self.store().read_index()
                    self._index = {k: v for k, v in index.items() if isinstance(v, dict)}
                except Exception as exc:
                    _warn(f"cannot read the index at {folder} ({exc}); loads, hits and last used are not shown")
        return self._index

    def store(self):
        """A gearcache Store on the folder (for its artifact checks; opening one writes nothing)."""
        from .store import Store

        if self._store is None:
            self._store = Store(self.root)
        return self._store

    def row(self, ekey: str) -> dict[str, Any]:
        return self.index().get(ekey) or {}

    # ------------------------------------------------------------------------------------------------- plans
    def gears(self, topology: str, method: str) -> list[list[dict[str, Any]]]:
        """The method's gear plans: per plan, its marked dims ``{name, leaf, dim, sizes}``."""
        folder = self.root / "entries" / topology / method / "plans"
        plans = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                dims = data["plan"]["dims"]
                plans.append([{"name": d.get("name"), "leaf": d.get("leaf"), "dim": d.get("dim"),
                               "sizes": list(d.get("sizes", []))} for d in dims])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        return plans

    def last_used(self, ref: EntryRef) -> float | None:
        row = self.row(ref.ekey)
        value = row.get("last_used") or row.get("created") or (ref.manifest or {}).get("created")
        return float(value) if isinstance(value, (int, float)) else None


def _scan_entries(root: pathlib.Path) -> Iterable[EntryRef]:
    from .key import FORMAT_VERSION

    base = root / "entries"
    if not base.is_dir():
        return
    for topo in sorted(p for p in base.iterdir() if p.is_dir()):
        for mdir in sorted(p for p in topo.iterdir() if p.is_dir()):
            for path in sorted(mdir.glob("*.json")):
                ref = EntryRef(topo.name, mdir.name, path.stem, path, None)
                try:
                    data = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError) as exc:
                    ref.problem = ("corrupt", f"entry manifest unreadable ({exc})")
                    yield ref
                    continue
                if not isinstance(data, dict) or data.get("ekey") != path.stem or not data.get("akey"):
                    ref.problem = ("corrupt", "entry manifest is malformed or names another entry key")
                elif data.get("format") != FORMAT_VERSION:
                    ref.problem = ("incompatible", f"entry format {data.get('format')!r}; this gearcache reads "
                                                   f"format {FORMAT_VERSION}")
                else:
                    ref.manifest = data
                yield ref


def _open(args: argparse.Namespace, must_exist: bool = True) -> Cache:
    from .store import default_root

    root = pathlib.Path(args.cache_dir) if args.cache_dir else default_root()
    if must_exist and not root.is_dir():
        where = "--cache-dir" if args.cache_dir else ("$GEARCACHE_HOME" if os.environ.get("GEARCACHE_HOME")
                                                      else "the default ./.gearcache")
        raise CliError(f"no cache folder at {root} ({where}). Pass --cache-dir PATH or set GEARCACHE_HOME")
    return Cache(root.resolve())


# ======================================================================================================= formatting
def format_table(headers: list[str], rows: list[list[Any]], right: Iterable[int] = ()) -> str:
    """Columns padded to their widest cell; the columns in ``right`` right-aligned (numbers)."""
    right = set(right)
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in
                         enumerate(zip(values, widths))).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def compact(value: Any, width: int | None = None) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(", ", ": "),
                                                           default=repr)
    if width is not None and len(text) > width:
        text = text[:width - 3] + "..."
    return text


def short_signature(desc: Any) -> str:
    from . import signature

    try:
        return signature.short(desc)
    except (KeyError, TypeError, AttributeError):
        return compact(desc, 60)


def fmt_gears(plans: list[list[dict[str, Any]]]) -> str:
    if not plans:
        return "-"
    return "; ".join(", ".join(f"{d['name']}:{d['dim']}={d['sizes']}".replace(" ", "") for d in dims)
                     for dims in plans)


def _warn(message: str) -> None:
    print(f"gearcache: warning: {message}", file=sys.stderr)


def _emit(args: argparse.Namespace, doc: dict[str, Any], human: Callable[[], str]) -> None:
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=False, default=repr))
    else:
        print(human())


# ============================================================================================================ ls
def cmd_ls(args: argparse.Namespace) -> int:
    cache = _open(args)
    rows = []
    gears_memo: dict[tuple[str, str], list] = {}
    for ref in cache.entries():
        if ref.manifest is None:
            _warn(f"skipping {ref.path}: {ref.problem[1]}")
            continue
        m, row = ref.manifest, cache.row(ref.ekey)
        key = (ref.topology, ref.method)
        if key not in gears_memo:
            gears_memo[key] = cache.gears(*key)
        rows.append({
            "method": ref.method, "topology": ref.topology, "ekey": ref.ekey,
            "signature": short_signature(m.get("signature")), "gears": gears_memo[key], "akey": ref.akey,
            "bytes": cache.artifact_bytes(ref.akey), "created": m.get("created"),
            "last_used": row.get("last_used"), "loads": row.get("loads", 0), "hits": row.get("hits", 0),
            "compile_seconds": m.get("compile_seconds"),
        })
    rows.sort(key=lambda r: (r["method"], r["topology"], r["created"] or 0))

    def human() -> str:
        if not rows:
            return f"no entries in {cache.root}"
        table = format_table(
            ["METHOD", "TOPOLOGY", "ENTRY", "SIGNATURE", "GEARS", "SIZE", "LAST USED", "LOADS", "HITS"],
            [[r["method"], r["topology"], r["ekey"][:12], r["signature"], fmt_gears(r["gears"]),
              fmt_bytes(r["bytes"]), fmt_time(r["last_used"]), r["loads"], r["hits"]] for r in rows],
            right=(5, 7, 8))
        return f"{table}\n{len(rows)} entr{'y' if len(rows) == 1 else 'ies'} in {cache.root}"

    _emit(args, {"cache_dir": str(cache.root), "entries": rows}, human)
    return OK


# ======================================================================================================= inspect
def _run_plan_status(folder: pathlib.Path) -> str:
    """Whether a warm process loads the artifact with gearcache's own loader (gearcache/runplan/), and if not why."""
    try:
        plan = json.loads((folder / "runplan" / "plan.json").read_text())
    except (OSError, ValueError):
        return "none (loads with torch's loader)"
    bound = "" if plan.get("device_free", True) else f"; runs on cuda:{plan.get('device_index')} only"
    if plan.get("supported"):
        return (f"yes: {len(plan.get('triton', {}))} Triton and {len(plan.get('cpp', {}))} C++ kernels, "
                f"torch's compiler not imported{bound}")
    return f"no ({plan.get('reason')}): loads with torch's loader{bound}"


def cmd_inspect(args: argparse.Namespace) -> int:
    from .capture import dependencies_changed

    cache = _open(args)
    refs = cache.resolve(args.entry)
    ref = refs[0]
    m = ref.manifest
    akey = m["akey"]
    folder = cache.root / "artifacts" / akey
    values, hashes = m.get("factors", {}).get("values", {}), m.get("factors", {}).get("hashes", {})
    factors = [{"name": n, "hash": hashes.get(n), "value": values.get(n)} for n in _ordered([*hashes, *values])]
    code = sorted(str(p) for p in (folder / "inductor").rglob("*.py")) if folder.is_dir() else []
    kernels = sorted(str(p) for p in (folder / "inductor").rglob("*")
                     if p.suffix in (".so", ".cubin", ".hsaco", ".ptx")) if folder.is_dir() else []
    deps = []
    for d in m.get("dependencies", []):
        changed = dependencies_changed([d]) if isinstance(d, dict) and "file" in d else "malformed"
        deps.append({**d, "changed": changed is not None})
    row = cache.row(ref.ekey)
    run_plan = _run_plan_status(folder)
    doc = {
        "ekey": ref.ekey, "method": ref.method, "topology": ref.topology,
        "also_in_topologies": [r.topology for r in refs[1:]], "manifest": str(ref.path),
        "signature": m.get("signature"), "signature_short": short_signature(m.get("signature")),
        "created": m.get("created"), "compile_seconds": m.get("compile_seconds"),
        "factors": factors, "akey": akey, "artifact_dir": str(folder), "artifact_exists": folder.is_dir(),
        "artifact_bytes": cache.artifact_bytes(akey), "artifact_factors": m.get("artifact_factors"),
        "generated_code": code, "kernels": kernels, "inputs": m.get("inputs"), "outputs": m.get("outputs"),
        "dependencies": deps, "index": row, "run_plan": run_plan, "value_guards": m.get("guards", []),
    }

    def human() -> str:
        out = [format_table(["", ""], [
            ["entry", ref.ekey], ["method", ref.method],
            ["topology", ", ".join([ref.topology] + doc["also_in_topologies"])], ["manifest", ref.path],
            ["signature", doc["signature_short"]], ["created", fmt_time(m.get("created"))],
            ["compile", f"{m.get('compile_seconds') or 0:.2f} s"],
            ["loads / hits", f"{row.get('loads', 0)} / {row.get('hits', 0)}"],
            ["last used", fmt_time(row.get("last_used"))],
            ["run plan", run_plan],
        ]).split("\n", 1)[1]]
        out += ["", "key factors:", _indent(format_table(
            ["FACTOR", "HASH", "VALUE"],
            [[f["name"], (f["hash"] or "-")[:16],
              short_signature(f["value"]) if f["name"] == "signature" else compact(f["value"], 90)]
             for f in factors]))]
        state = "" if folder.is_dir() else "  (MISSING)"
        out += ["", f"artifact {akey}{state}", f"  folder: {folder}", f"  size:   {fmt_bytes(doc['artifact_bytes'])}"]
        out += ["", "generated code:"] + [f"  {p}" for p in code or ["(none)"]]
        if kernels:
            out += ["kernels:"] + [f"  {p}" for p in kernels]
        out += ["", "graph inputs (recipe):", _indent(format_table(
            ["#", "KIND", "SOURCE"], [[i, k, _describe_input(k, r, m)] for i, (k, r) in enumerate(m.get("inputs", []))],
            right=(0,)))]
        outs = m.get("outputs") or {}
        out += ["", f"graph outputs (recipe): structure {compact(outs.get('structure'), 90)}", _indent(format_table(
            ["#", "KIND", "SOURCE"], [[i, k, compact(r, 60)] for i, (k, r) in enumerate(outs.get("leaves", []))],
            right=(0,)))]
        out += ["", f"value guards ({len(doc['value_guards'])}: Python values the graph bakes in, checked when the "
                    f"entry is chosen):"]
        out += [f"  {_describe_guard(g)}" for g in doc["value_guards"][:40]] or ["  (none)"]
        if len(doc["value_guards"]) > 40:
            out.append(f"  ... {len(doc['value_guards']) - 40} more (--json lists them all)")
        out += ["", "dependencies:"]
        out += [f"  {d.get('file')}:{d.get('first_line')}+{d.get('n_lines')}  {d.get('name')}  "
                f"sha256 {str(d.get('sha256'))[:12]}{'  CHANGED since compile' if d['changed'] else ''}"
                for d in deps] or ["  (none)"]
        return "\n".join(out)

    _emit(args, doc, human)
    return OK


def _describe_guard(record: list) -> str:
    """One value guard of a manifest, as ``path (kind): expected``."""
    from .guards import ValueGuard

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


def _ordered(names: Iterable[str]) -> list[str]:
    """Factor names in key order (the order the entry key hashes them), unknown ones last."""
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (FACTOR_ORDER.index(n) if n in FACTOR_ORDER else len(FACTOR_ORDER), n))


def _indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in text.splitlines())


# ======================================================================================================= explain
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


def _diff_doc(hashes_a: dict, values_a: dict, hashes_b: dict, values_b: dict) -> list[dict[str, Any]]:
    from .diagnostics import differing_factors

    return [{"factor": n, "hash_a": hashes_a.get(n), "hash_b": hashes_b.get(n),
             "value_a": values_a.get(n), "value_b": values_b.get(n)}
            for n in _ordered(differing_factors(hashes_a, hashes_b))]


def _diff_table(diffs: list[dict[str, Any]], label_a: str, label_b: str) -> str:
    rows = []
    for d in diffs:
        for what, va, vb in value_diffs(d["factor"], d["value_a"], d["value_b"]):
            rows.append([what, compact(va, 70), compact(vb, 70)])
    return format_table(["FACTOR", label_a, label_b], rows)


def cmd_explain(args: argparse.Namespace) -> int:
    if args.method and args.entries:
        raise CliError("explain takes either two entries or --method NAME, not both")
    if args.method:
        return _explain_miss(args)
    if len(args.entries) != 2:
        raise CliError("explain needs two entries (ENTRY_A ENTRY_B) or --method NAME")
    cache = _open(args)
    a, b = (cache.resolve(name)[0] for name in args.entries)
    fa, fb = a.manifest.get("factors", {}), b.manifest.get("factors", {})
    diffs = _diff_doc(fa.get("hashes", {}), fa.get("values", {}), fb.get("hashes", {}), fb.get("values", {}))
    doc = {"a": {"ekey": a.ekey, "method": a.method, "topology": a.topology},
           "b": {"ekey": b.ekey, "method": b.method, "topology": b.topology},
           "differs": diffs, "same": not diffs}

    def human() -> str:
        head = f"A = {a.ekey} ({a.method})\nB = {b.ekey} ({b.method})"
        if not diffs:
            return f"{head}\nthe two entries have the same key factors"
        return (f"{head}\n{len(diffs)} key factor(s) differ: {', '.join(d['factor'] for d in diffs)}\n\n"
                f"{_diff_table(diffs, 'A', 'B')}")

    _emit(args, doc, human)
    return FAILED if diffs else OK


def _explain_miss(args: argparse.Namespace) -> int:
    """The latest recorded miss of the method that is still a miss (no entry of its key on disk), against the nearest
    entry: exit 1. When every recorded miss has compiled since: the latest one, what it compiled to and why it
    missed then: exit 0."""
    cache = _open(args)
    method = _resolve_method(cache, args.method)
    records = _miss_records(cache, method)
    if not records:
        doc = {"method": method, "miss": None, "differs": []}
        _emit(args, doc, lambda: f"no recorded miss of {method} in {cache.root} (misses are recorded when gearcache "
                                 f"compiles an entry)")
        return OK
    entries = {(r.topology, r.ekey): r for r in cache.good_entries() if r.method == method}
    missing = [r for r in records if (r[2].get("topology") or r[1].parent.parent.name, r[2].get("ekey")) not in
               entries]
    when, path, miss = max(missing or records, key=lambda r: r[0])
    topology = miss.get("topology") or path.parent.parent.name
    compiled = entries.get((topology, miss.get("ekey")))
    doc: dict[str, Any] = {
        "method": method, "topology": topology,
        "miss": {"ekey": miss.get("ekey"), "time": when, "time_iso": _iso(when), "record": str(path),
                 "signature": short_signature(miss["factors"].get("values", {}).get("signature")),
                 "compiled_as_entry": compiled is not None}}
    head = (f"latest miss of {method} ({topology}) at {fmt_time(when)}: entry {miss.get('ekey')}\n"
            f"  call signature: {doc['miss']['signature']}")
    if compiled is not None:
        return _explain_compiled(args, doc, head, miss, compiled)
    return _explain_still_missing(args, cache, doc, head, miss)


def _miss_records(cache: Cache, method: str) -> list[tuple[float, pathlib.Path, dict[str, Any]]]:
    """The recorded misses of ``method`` (diagnostics.record_miss): ``(time, path, record)``."""
    records = []
    for path in (cache.root / "misses").glob(f"*/{method}/*.json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("factors"), dict):
                records.append((float(data.get("time", path.stat().st_mtime)), path, data))
        except (OSError, ValueError, TypeError):
            continue
    return records


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

    _emit(args, doc, human)
    return OK


def _explain_still_missing(args: argparse.Namespace, cache: Cache, doc: dict[str, Any], head: str,
                           miss: dict[str, Any]) -> int:
    """The miss has no entry on disk: the key factors it differs in from the nearest entry of the method; exit 1."""
    from .diagnostics import nearest_entry

    topology, method = doc["topology"], doc["method"]
    hashes, values = miss["factors"].get("hashes", {}), miss["factors"].get("values", {})
    candidates = [r.manifest for r in cache.good_entries() if r.method == method and r.topology == topology]
    nearest, _ = nearest_entry(candidates, hashes, exclude=miss.get("ekey"))
    diffs = []
    if nearest is not None:
        nf = nearest.get("factors", {})
        diffs = _diff_doc(hashes, values, nf.get("hashes", {}), nf.get("values", {}))
    doc.update(compiled_to=None, nearest=nearest.get("ekey") if nearest else None, differs=diffs)

    def human() -> str:
        top = f"{head}\nstill a miss: no entry of this key is on disk"
        if nearest is None:
            return f"{top}\nno other entry of {method} to compare with"
        return (f"{top}\nnearest entry: {nearest['ekey']} ({short_signature(nearest.get('signature'))})\n"
                f"{len(diffs)} key factor(s) differ: {', '.join(d['factor'] for d in diffs)}\n\n"
                f"{_diff_table(diffs, 'MISS', 'NEAREST ENTRY')}")

    _emit(args, doc, human)
    return FAILED


def _resolve_method(cache: Cache, name: str) -> str:
    """An exact method name, or the one known method name that ends with ``name`` (``Model.forward``)."""
    known = {r.method for r in cache.entries()}
    misses = cache.root / "misses"
    if misses.is_dir():
        known |= {p.name for p in misses.glob("*/*") if p.is_dir()}
    if name in known:
        return name
    matches = sorted(k for k in known if k.endswith("." + name) or k.endswith(name))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CliError(f"no method {name!r} in {cache.root}; known: {', '.join(sorted(known)) or '(none)'}")
    raise CliError(f"method {name!r} is ambiguous: {', '.join(matches)}")


# ======================================================================================================== verify
def _machine() -> tuple[dict[str, str], set[str]]:
    import torch

    from . import _torch_compat as compat

    devices = {compat.device_capability("cpu")}
    if torch.cuda.is_available():
        devices |= {compat.device_capability(f"cuda:{i}") for i in range(torch.cuda.device_count())}
    return dict(compat.software_versions()), devices


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


def _artifact_status(cache: Cache, akey: str, memo: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """("ok" | "corrupt" | "orphaned", detail) for an artifact; verified once."""
    from .errors import GearcacheError

    if akey not in memo:
        try:
            cache.store().verify_artifact(akey)
            memo[akey] = ("ok", "")
        except FileNotFoundError:
            memo[akey] = ("orphaned", f"artifact {akey} is missing")
        except (GearcacheError, OSError) as exc:
            memo[akey] = ("corrupt", str(exc))
    return memo[akey]


def _trust_fix(path: pathlib.Path, why: str) -> str:
    if "owned by" in why:
        return f"`chown -R {getpass.getuser()} {path}` (the serving user must own the store), or use a private cache_dir"
    return f"`chmod go-w {path}`"


def untrusted_folders(cache: Cache) -> list[dict[str, str]]:
    """The store's folders the runtime refuses (gearcache/store/trust.py): another user owns them or others can
    write them. A refused root, ``entries/`` or ``artifacts/`` refuses the whole store. ``[{"path", "why", "fix"}]``."""
    store = cache.store()
    out = []
    for path in (cache.root, cache.root / "entries", cache.root / "artifacts"):
        why = store.untrusted_why(path)
        if why is not None:
            out.append({"path": str(path), "why": why, "fix": _trust_fix(path, why)})
    return out


def _untrusted_entry(cache: Cache, ref: EntryRef) -> tuple[str, str] | None:
    """("untrusted", why and fix) when the runtime refuses this entry manifest or its method folder."""
    for path in (ref.path.parent, ref.path):
        why = cache.store().untrusted_why(path)
        if why is not None:
            return ("untrusted", f"{path}: {why}; the entry is never loaded. Fix: {_trust_fix(path, why)}")
    return None


def check_entries(cache: Cache) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """Per entry: its problems ``[(status, detail)]``, in order corrupt, orphaned, untrusted, incompatible. Also
    the artifacts' statuses."""
    software, devices = _machine()
    memo: dict[str, tuple[str, str]] = {}
    results = []
    for ref in cache.entries():
        problems = []
        untrusted = _untrusted_entry(cache, ref)
        if ref.manifest is None:
            problems.append(ref.problem)
        else:
            status, detail = _artifact_status(cache, ref.akey, memo)
            if status != "ok":
                problems.append((status, detail))
            problems += [untrusted] if untrusted else []
            problems += [("incompatible", why) for why in incompatibilities(ref.manifest, software, devices)]
        results.append({"ref": ref, "problems": problems})
    for akey in cache.artifact_keys():
        _artifact_status(cache, akey, memo)
    return results, memo


def cmd_verify(args: argparse.Namespace) -> int:
    cache = _open(args)
    results, artifacts = check_entries(cache)
    referenced = {r["ref"].akey for r in results if r["ref"].akey}
    rows = []
    for r in results:
        ref, problems = r["ref"], r["problems"]
        rows.append({"ekey": ref.ekey, "method": ref.method, "topology": ref.topology, "akey": ref.akey,
                     "status": problems[0][0] if problems else "ok",
                     "problems": [{"status": s, "detail": d} for s, d in problems]})
    loose = [{"akey": k, "status": "corrupt" if s == "corrupt" else "unreferenced", "detail": d}
             for k, (s, d) in artifacts.items() if k not in referenced]
    summary: dict[str, int] = {}
    for row in rows:
        summary[row["status"]] = summary.get(row["status"], 0) + 1
    refused = untrusted_folders(cache)
    failed = (any(r["status"] != "ok" for r in rows) or any(a["status"] == "corrupt" for a in loose)
              or bool(refused))
    doc = {"cache_dir": str(cache.root), "ok": not failed, "summary": summary, "entries": rows,
           "unreferenced_artifacts": loose, "untrusted_folders": refused}

    def human() -> str:
        out = []
        if refused:
            out += ["REFUSED: gearcache loads nothing from this store and writes nothing to it (every call compiles, "
                    "in memory only):"]
            out += [f"  {f['path']}: {f['why']}. Fix: {f['fix']}" for f in refused] + [""]
        if rows:
            out.append(format_table(["STATUS", "METHOD", "ENTRY", "ARTIFACT", "DETAIL"], [
                [r["status"], r["method"], r["ekey"][:12], (r["akey"] or "-")[:12],
                 "; ".join(p["detail"] for p in r["problems"]) or ""] for r in rows]))
        else:
            out.append(f"no entries in {cache.root}")
        if loose:
            out += ["", "artifacts no entry references:", _indent(format_table(
                ["STATUS", "ARTIFACT", "DETAIL"], [[a["status"], a["akey"], a["detail"]] for a in loose]))]
        counts = ", ".join(f"{n} {s}" for s, n in sorted(summary.items())) or "0 entries"
        out += ["", f"{counts}: {'PROBLEMS FOUND' if failed else 'all ok'}"]
        return "\n".join(out)

    _emit(args, doc, human)
    return FAILED if failed else OK


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


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of days >= 0")
    return value


def select_for_prune(cache: Cache, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """path of each selected entry manifest -> {"ref", "reasons"}."""
    chosen: dict[str, dict[str, Any]] = {}

    def pick(ref: EntryRef, reason: str) -> None:
        chosen.setdefault(str(ref.path), {"ref": ref, "reasons": []})["reasons"].append(reason)

    if args.corrupt or args.incompatible:
        results, _ = check_entries(cache)
        for r in results:
            for status, detail in r["problems"]:
                if (status in ("corrupt", "orphaned") and args.corrupt) or (status == "incompatible" and
                                                                            args.incompatible):
                    pick(r["ref"], f"{status}: {detail}")
                    break
    now = time.time()
    if args.older_than is not None:
        cutoff = now - args.older_than * 86400
        for ref in cache.entries():
            used = cache.last_used(ref) if ref.manifest is not None else None
            if used is not None and used < cutoff:
                pick(ref, f"last used {fmt_time(used)}, more than {args.older_than:g} days ago")
    if args.max_size is not None:
        refs: dict[str, int] = {}
        for ref in cache.good_entries():
            if str(ref.path) not in chosen:
                refs[ref.akey] = refs.get(ref.akey, 0) + 1
        total = sum(cache.artifact_bytes(k) or 0 for k in cache.artifact_keys() if k in refs)
        lru = sorted((r for r in cache.good_entries() if str(r.path) not in chosen),
                     key=lambda r: cache.last_used(r) or 0.0)
        for ref in lru:
            if total <= args.max_size:
                break
            pick(ref, f"least recently used ({fmt_time(cache.last_used(ref))}) while the artifacts exceed "
                      f"{fmt_bytes(args.max_size)}")
            refs[ref.akey] -= 1
            if refs[ref.akey] == 0:
                total -= cache.artifact_bytes(ref.akey) or 0
    return chosen


def cmd_prune(args: argparse.Namespace) -> int:
    if args.older_than is None and args.max_size is None and not args.incompatible and not args.corrupt:
        raise CliError("prune needs at least one of --older-than DAYS, --max-size BYTES, --incompatible, --corrupt")
    cache = _open(args)
    chosen = select_for_prune(cache, args)
    doomed = {str(c["ref"].path) for c in chosen.values()}
    remaining = {r.akey for r in cache.entries() if str(r.path) not in doomed and r.akey}
    artifacts = sorted({c["ref"].akey for c in chosen.values() if c["ref"].akey} - remaining)
    artifacts = [k for k in artifacts if (cache.root / "artifacts" / k).is_dir()]
    entry_rows = [{"ekey": c["ref"].ekey, "method": c["ref"].method, "topology": c["ref"].topology,
                   "akey": c["ref"].akey, "path": str(c["ref"].path), "reasons": c["reasons"]}
                  for c in chosen.values()]
    art_rows = [{"akey": k, "bytes": cache.artifact_bytes(k)} for k in artifacts]
    deleted_arts, locked = [], []
    if args.yes:
        deleted_arts, locked = _delete(cache, chosen, artifacts)
    freed = sum(a["bytes"] or 0 for a in art_rows if not args.yes or a["akey"] in deleted_arts)
    doc = {"cache_dir": str(cache.root), "dry_run": not args.yes, "entries": entry_rows, "artifacts": art_rows,
           "deleted_artifacts": deleted_arts, "skipped_locked": locked, "bytes_freed": freed}

    def human() -> str:
        if not entry_rows:
            return "nothing to prune"
        verb = "deleted" if args.yes else "would delete"
        out = [f"{verb} {len(entry_rows)} entr{'y' if len(entry_rows) == 1 else 'ies'}:", _indent(format_table(
            ["METHOD", "ENTRY", "ARTIFACT", "REASON"],
            [[r["method"], r["ekey"][:12], (r["akey"] or "-")[:12], "; ".join(r["reasons"])] for r in entry_rows]))]
        if art_rows:
            out += [f"{verb} {len(deleted_arts) if args.yes else len(art_rows)} artifact(s), {fmt_bytes(freed)}:"]
            skipped = "  (skipped: locked or in use by a running process)"
            out += [f"  {a['akey']}  {fmt_bytes(a['bytes'])}{skipped if a['akey'] in locked else ''}" for a in art_rows]
        if not args.yes:
            out += ["dry run: nothing was deleted; pass --yes to delete"]
        return "\n".join(out)

    _emit(args, doc, human)
    return OK


def _delete(cache: Cache, chosen: dict[str, dict[str, Any]], artifacts: list[str]) -> tuple[list[str], list[str]]:
    """Delete entry manifests, then the artifacts no remaining entry references (under their locks; an artifact a
    live process has a lease on stays), then index rows. Returns (deleted artifact keys, artifact keys skipped because
    a running process holds their lock or uses them)."""
    from .errors import LockTimeoutError

    for c in chosen.values():
        ref = c["ref"]
        ref.path.unlink(missing_ok=True)
        log.info("%s: pruned entry %s: %s", ref.method, ref.ekey, "; ".join(c["reasons"]))
    remaining = cache.entries(refresh=True)
    still_used = {r.akey for r in remaining if r.akey}
    deleted, locked = [], []
    (cache.root / "locks").mkdir(mode=0o700, exist_ok=True)
    (cache.root / "tmp").mkdir(mode=0o700, exist_ok=True)
    for akey in artifacts:
        if akey in still_used:
            continue                # an entry written meanwhile uses it again
        try:                        # the writers' own lock, of either lock_mode (flock or soft)
            with cache.store().locked_in_every_mode(akey, 0):
                status = cache.store().remove_artifact(akey)      # moved aside at once: never seen half deleted
        except LockTimeoutError:
            locked.append(akey)
            _warn(f"artifact {akey} is locked by a running process; left in place")
            continue
        if status == "removed":
            deleted.append(akey)
            log.info("pruned artifact %s", akey)
        elif status != "gone":
            locked.append(akey)
            _warn(f"artifact {akey} is {status}; left in place")
    _forget(cache, [c["ref"].ekey for c in chosen.values()], {r.ekey for r in remaining}, deleted)
    return deleted, locked


def _forget(cache: Cache, ekeys: list[str], kept_ekeys: set[str], akeys: list[str]) -> None:
    """Remove the index rows of pruned entries (unless another topology still has the same key) and artifacts."""
    try:
        index = cache.store().index
        for key in [k for k in ekeys if k not in kept_ekeys] + [f"artifact:{a}" for a in akeys]:
            index.pop(key, None)
    except Exception as exc:
        _warn(f"index rows were not removed ({exc}); they are bookkeeping only")


# ======================================================================================================== warmup
def _load_factory(spec: str) -> Callable[[], Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:make_model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"cannot import {module_name!r} ({exc}); run from the folder that holds it or install it")
    except Exception as exc:
        raise CliError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliError(f"{spec} is not callable")
    return obj


def cmd_warmup(args: argparse.Namespace) -> int:
    import torch

    from .cached_function import CachedFunction
    from .counters import counters

    if args.cache_dir:
        os.environ["GEARCACHE_HOME"] = str(args.cache_dir)   # for cache_compile(..., cache_dir=None) in the factory
    factory = _load_factory(args.factory)
    try:
        made = factory()
    except Exception as exc:
        raise CliError(f"{args.factory}() raised {type(exc).__name__}: {exc}", FAILED) from exc
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise CliError(f"{args.factory}() must return (model, example_args) or (model, example_args, example_kwargs); "
                       f"got {type(made).__qualname__}")
    model, example_args = made[0], made[1]
    example_kwargs = made[2] if len(made) == 3 else {}
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    if not isinstance(example_args, (tuple, list)) or not isinstance(example_kwargs, dict):
        raise CliError(f"{args.factory}(): example_args must be a tuple and example_kwargs a dict")
    methods = [(name, value) for name, value in sorted(vars(model).items()) if isinstance(value, CachedFunction)]
    if not methods:
        raise CliError(f"{type(model).__qualname__} has no cache_compile'd attribute (a gearcache.CachedFunction), "
                       f"so there is nothing to warm up")
    rows, failed = [], False
    for name, cf in methods:
        print(f"gearcache warmup: {name} ({cf.name}) ...", file=sys.stderr, flush=True)
        before, t0 = counters.snapshot(), time.perf_counter()
        try:
            with torch.inference_mode():
                n = cf.warmup(*example_args, **example_kwargs)
        except Exception as exc:
            failed = True
            print(f"gearcache warmup: {name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            rows.append({"attribute": name, "method": cf.name, "gears": None, "error": f"{type(exc).__name__}: {exc}",
                         "cache_dir": str(cf.store.root)})
            continue
        dt, delta = time.perf_counter() - t0, counters.delta(before)
        print(f"gearcache warmup: {name}: {n} gear(s) in {dt:.2f} s ({delta['compiles']} compiled, "
              f"{delta['loads']} loaded)", file=sys.stderr, flush=True)
        rows.append({"attribute": name, "method": cf.name, "gears": n, "seconds": round(dt, 3),
                     "compiled": delta["compiles"], "loaded": delta["loads"], "cache_dir": str(cf.store.root)})

    def human() -> str:
        return format_table(["ATTRIBUTE", "METHOD", "GEARS", "COMPILED", "LOADED", "SECONDS", "CACHE DIR"], [
            [r["attribute"], r["method"], r["gears"] if r["gears"] is not None else "FAILED", r.get("compiled"),
             r.get("loaded"), f"{r['seconds']:.2f}" if "seconds" in r else None, r["cache_dir"]] for r in rows],
            right=(2, 3, 4, 5))

    _emit(args, {"methods": rows, "ok": not failed}, human)
    return FAILED if failed else OK


# ========================================================================================================= stats
def cmd_stats(args: argparse.Namespace) -> int:
    cache = _open(args)
    entries = cache.good_entries()
    akeys = [k for k in cache.artifact_keys() if cache.artifact_manifest(k) is not None]
    rows = [cache.row(e.ekey) for e in {e.ekey: e for e in entries}.values()]

    def total(key: str) -> float:
        return sum(r.get(key, 0) or 0 for r in rows)

    # elements of the geared inputs of served calls: as the entries ran them (padded to a gear), as callers passed them
    padded, real = total("padded_elements"), total("real_elements")
    waste = (1.0 - real / padded) if padded else None
    doc = {
        "cache_dir": str(cache.root), "entries": len(entries),
        "methods": len({(e.topology, e.method) for e in entries}),
        "artifacts": len(akeys), "total_bytes": sum(cache.artifact_bytes(k) or 0 for k in akeys),
        "loads": int(total("loads")), "hits": int(total("hits")),
        "compile_seconds": round(sum(float(e.manifest.get("compile_seconds") or 0) for e in entries), 3),
        "load_seconds": round(total("load_seconds"), 3), "padding_waste": waste,
        "real_elements": int(real), "padded_elements": int(padded),
        "unreadable_entries": len(cache.entries()) - len(entries),
    }

    def human() -> str:
        return format_table(["", ""], [
            ["cache dir", doc["cache_dir"]], ["entries", doc["entries"]], ["methods", doc["methods"]],
            ["artifacts", doc["artifacts"]],
            ["total size", f"{fmt_bytes(doc['total_bytes'])} ({doc['total_bytes']} bytes)"],
            ["loads", doc["loads"]], ["hits", doc["hits"]], ["compile seconds", f"{doc['compile_seconds']:.2f}"],
            ["load seconds", f"{doc['load_seconds']:.3f}"],
            ["padding waste", "n/a" if waste is None else f"{waste:.1%}"],
        ]).split("\n", 1)[1]

    _emit(args, doc, human)
    return OK


# ========================================================================================================== native
def cmd_native(args: argparse.Namespace) -> int:
    """``status``: the native checks' folder, key and state; ``build``: build them now (exit 1 if that fails)."""
    from . import native
    from .errors import NativeBuildError
    from .native import build

    if args.action == "build":
        try:
            build.build()
        except NativeBuildError as exc:
            raise CliError(str(exc), FAILED) from exc
    native.guards(build_if_missing=False)           # load it if it is there: status() then says so
    doc = native.status()

    def human() -> str:
        state = "built" if doc["built"] else ("failed (see build.log)" if doc["failed"] else "not built")
        lines = [f"native checks: {state}{'' if doc['enabled'] else ' (turned off: GEARCACHE_NATIVE=0)'}",
                 f"folder: {os.path.join(doc['dir'], doc['key'])}",
                 *[f"  {name}: {value}" for name, value in doc["key_parts"].items()]]
        return "\n".join(lines)
    _emit(args, doc, human)
    return OK


# ========================================================================================================== main
def build_parser() -> argparse.ArgumentParser:
    from . import cli_remote

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", metavar="PATH",
                        help="the cache folder (default: $GEARCACHE_HOME, else ./.gearcache)")
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    cli_remote.add_arguments(common)

    parser = argparse.ArgumentParser(
        prog="gearcache", description="Look into, check, prune and warm up a gearcache folder.",
        epilog="exit status: 0 ok, 1 a check failed (verify found problems, explain found a miss that is still one), "
               "2 usage error, missing folder or unknown entry")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("ls", parents=[common], help="list entries",
                       description="One row per entry: method, topology, signature, gears, artifact size, last used, "
                                   "loads, hits.")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", parents=[common], help="show one entry",
                       description="An entry's key factors and their hashes, artifact, generated code, graph input "
                                   "and output recipes, and dependencies.")
    p.add_argument("entry", metavar="ENTRY", help=f"an entry key, or its first {ENTRY_PREFIX_MIN}+ characters")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("explain", parents=[common], help="which key factors differ (two entries, or a miss)",
                       description="`explain A B`: the key factors two entries differ in, with both values. "
                                   "`explain --method NAME`: the key factors in which the latest recorded miss of "
                                   "NAME that is still a miss (no entry of its key on disk) differs from the "
                                   "nearest entry; when every recorded miss has compiled since, what the latest one "
                                   "compiled to (exit 0). Exits 1 when differences are shown.")
    p.add_argument("entries", nargs="*", metavar="ENTRY", help="two entry keys (or prefixes)")
    p.add_argument("--method", metavar="NAME", help="a method name (module.Class.method, or a unique end of one)")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("verify", parents=[common], help="check digests and compatibility",
                       description="Check every artifact's digests, each entry's compatibility with this machine "
                                   "(software versions, devices), that its artifact exists, and every folder and "
                                   "file mode or owner the runtime refuses to load from (with the fix). Reports ok "
                                   "/ corrupt / orphaned / untrusted / incompatible per entry; exits 1 on any "
                                   "problem.")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("prune", parents=[common], help="delete entries (dry run unless --yes)",
                       description="Select entries by age, total size, compatibility or corruption and delete them "
                                   "with their unreferenced artifacts. A dry run unless --yes.")
    p.add_argument("--older-than", type=_non_negative, metavar="DAYS", help="entries last used more than DAYS ago")
    p.add_argument("--max-size", type=parse_size, metavar="BYTES",
                   help="evict least recently used entries until the artifacts total at most BYTES (500M, 2G ok)")
    p.add_argument("--incompatible", action="store_true", help="entries this machine cannot load")
    p.add_argument("--corrupt", action="store_true", help="entries whose manifest or artifact is corrupt or missing")
    p.add_argument("--all", action="store_true", help="with --remote: every key of the remote store")
    p.add_argument("--yes", action="store_true", help="really delete (default: print what would go)")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("warmup", parents=[common], help="compile or load every gear of a model",
                       description="Import MODULE (the current folder is on sys.path), call FACTORY() -> (model, "
                                   "example_args[, example_kwargs]) and run .warmup() of every cache_compile'd "
                                   "attribute of the model under torch.inference_mode().")
    p.add_argument("factory", metavar="MODULE:FACTORY")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("stats", parents=[common], help="totals",
                       description="Entries, artifacts, bytes, loads, hits, compile and load seconds, padding waste "
                                   "(the share of padding in the geared inputs the entries ran for callers' calls, "
                                   "recorded by every process at exit; n/a without geared calls).")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("native", help="gearcache's native checks for this torch: status, or build them now",
                       description="The dispatch shortcut's checks compiled against this torch's headers "
                                   "(gearcache/native/): where they live, their build key and whether they are "
                                   "built; `build` builds them now (a process that lacks them starts that in the "
                                   "background). Ignores --cache-dir: they live in $GEARCACHE_NATIVE_DIR, else "
                                   "~/.cache/gearcache/native.")
    p.add_argument("action", nargs="?", choices=("status", "build"), default="status")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=cmd_native)

    cli_remote.add_commands(sub, common)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    from . import cli_remote

    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "remote", None) and args.command in cli_remote.REMOTE_COMMANDS:
            return cli_remote.dispatch(args)
        return args.func(args)
    except CliError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc), "exit_code": exc.code}))
        print(f"gearcache {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:                  # `gearcache ls | head`
        sys.stdout = open(os.devnull, "w")
        return OK


if __name__ == "__main__":
    sys.exit(main())
