"""What ``gearcache`` prints: exit statuses, tables, sizes and times, and the one JSON document of ``--json``."""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any, Callable, Iterable

OK, FAILED, USAGE = 0, 1, 2         # exit statuses: ok; a check failed; a usage error, missing folder or unknown entry


def emit(args: argparse.Namespace, doc: dict[str, Any], human: Callable[[], str]) -> None:
    """Print ``doc`` as one JSON document with ``--json``, else ``human()``."""
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=False, default=repr))
    else:
        print(human())


def warn(message: str) -> None:
    print(f"gearcache: warning: {message}", file=sys.stderr)


def format_table(headers: list[str], rows: list[list[Any]], right: Iterable[int] = ()) -> str:
    """Columns padded to their widest cell; the columns in ``right`` right-aligned (numbers)."""
    right = set(right)
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in
                         enumerate(zip(values, widths))).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def format_pairs(rows: list[list[Any]]) -> str:
    """A two-column table of ``[name, value]`` rows, without a header line."""
    return format_table(["", ""], rows).split("\n", 1)[1]


def indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in text.splitlines())


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


def iso_time(ts: float | None) -> str | None:
    return None if ts is None else datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def compact(value: Any, width: int | None = None) -> str:
    """``value`` on one line (JSON unless a string), cut to ``width`` characters with ``...``."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(", ", ": "),
                                                           default=repr)
    if width is not None and len(text) > width:
        text = text[:width - 3] + "..."
    return text


def short_signature(desc: Any) -> str:
    from ..call import signature

    try:
        return signature.short(desc)
    except (KeyError, TypeError, AttributeError):
        return compact(desc, 60)


def fmt_gears(plans: list[list[dict[str, Any]]]) -> str:
    """A method's gear plans (per plan, its marked dims ``{name, leaf, dim, sizes}``) as ``x:0=[1,2,4]; ...``."""
    if not plans:
        return "-"
    return "; ".join(", ".join(f"{d['name']}:{d['dim']}={d['sizes']}".replace(" ", "") for d in dims)
                     for dims in plans)


def plural_entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"
