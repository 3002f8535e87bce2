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
                                           gearcache/cli/remote.py

Every subcommand takes ``--cache-dir`` (default ``$GEARCACHE_HOME``, else ``./.gearcache``; ls, verify, prune and stats
also as a positional ``FOLDER``: ``gearcache ls DIR``) and ``--json`` (one JSON
document on stdout). Exit status: 0 ok; 1 a check failed (verify found problems, explain found a miss that is still a
miss, or two entries that differ); 2 a usage error, a missing cache folder or an unknown entry.

The CLI is a client of the store (gearcache/store/): it has no file format, path or lock of its own. Modules:

    __init__.py   the parser, ``main()``            output.py   exit statuses, tables, ``--json``
    folder.py     the cache folder through its ``Store``        local.py    ls, inspect, stats
    explain.py    explain                           checks.py   verify, prune
    runtime.py    warmup, native                    remote.py   push, pull, and the ``--remote`` commands
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..errors import CliError
from . import remote
from .checks import cmd_prune, cmd_verify, non_negative_days, parse_size
from .explain import cmd_explain
from .folder import ENTRY_PREFIX_MIN
from .local import cmd_inspect, cmd_ls, cmd_stats
from .output import OK
from .runtime import cmd_native, cmd_warmup

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", metavar="PATH",
                        help="the cache folder (default: $GEARCACHE_HOME, else ./.gearcache)")
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    remote.add_arguments(common)

    parser = argparse.ArgumentParser(
        prog="gearcache", description="Look into, check, prune and warm up a gearcache folder.",
        epilog="exit status: 0 ok, 1 a check failed (verify found problems, explain found a miss that is still one), "
               "2 usage error, missing folder or unknown entry")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_read_commands(sub, common)             # the order of `gearcache --help`
    _add_check_commands(sub, common)
    _add_runtime_commands(sub, common)
    remote.add_commands(sub, common)
    return parser


def _add_read_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """ls, inspect, explain."""
    p = sub.add_parser("ls", parents=[common], help="list entries",
                       description="One row per entry: method, topology, signature, gears, artifact size, last used, "
                                   "loads, hits.")
    _add_folder(p)
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


def _add_check_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """verify, prune."""
    p = sub.add_parser("verify", parents=[common], help="check digests and compatibility",
                       description="Check every artifact's digests, each entry's compatibility with this machine "
                                   "(software versions, devices), that its artifact exists, and every folder and "
                                   "file mode or owner the runtime refuses to load from (with the fix). Reports ok "
                                   "/ corrupt / orphaned / untrusted / incompatible per entry; exits 1 on any "
                                   "problem.")
    _add_folder(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("prune", parents=[common], help="delete entries (dry run unless --yes)",
                       description="Select entries by age, total size, compatibility or corruption and delete them "
                                   "with their unreferenced artifacts. A dry run unless --yes.")
    p.add_argument("--older-than", type=non_negative_days, metavar="DAYS",
                   help="entries last used more than DAYS ago")
    p.add_argument("--max-size", type=parse_size, metavar="BYTES",
                   help="evict least recently used entries until the artifacts total at most BYTES (500M, 2G ok)")
    p.add_argument("--incompatible", action="store_true", help="entries this machine cannot load")
    p.add_argument("--corrupt", action="store_true", help="entries whose manifest or artifact is corrupt or missing")
    p.add_argument("--all", action="store_true", help="with --remote: every key of the remote store")
    p.add_argument("--yes", action="store_true", help="really delete (default: print what would go)")
    _add_folder(p)
    p.set_defaults(func=cmd_prune)


def _add_runtime_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """warmup, stats, native."""
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
    _add_folder(p)
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


def _add_folder(p: argparse.ArgumentParser) -> None:
    """The cache folder as an optional positional (``gearcache ls DIR``), the same as ``--cache-dir DIR``."""
    p.add_argument("folder", nargs="?", metavar="FOLDER", help="the cache folder (as --cache-dir)")


def _folder_argument(args: argparse.Namespace) -> None:
    """``FOLDER`` into ``args.cache_dir``; a usage error where it and ``--cache-dir`` name other folders, or where
    ``--remote`` makes the command read the remote store (the folder would be ignored)."""
    folder = getattr(args, "folder", None)
    if folder is None:
        return
    if args.cache_dir and os.path.abspath(args.cache_dir) != os.path.abspath(folder):
        raise CliError(f"FOLDER={folder!r} and --cache-dir={args.cache_dir!r} name two folders: give one of them")
    if getattr(args, "remote", None) and args.command in remote.REMOTE_COMMANDS:
        raise CliError(f"FOLDER={folder!r} with --remote={args.remote!r}: `{args.command} --remote` reads the remote "
                       f"store, not a folder. Fix: leave out FOLDER, or --remote to read the folder")
    args.cache_dir = folder


def _version() -> str:
    from .. import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    """Run one ``gearcache`` command; its exit status."""
    args = build_parser().parse_args(argv)
    try:
        _folder_argument(args)
        if getattr(args, "remote", None) and args.command in remote.REMOTE_COMMANDS:
            return remote.dispatch(args)
        status: int = args.func(args)
        return status
    except CliError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc), "exit_code": exc.code}))
        print(f"gearcache {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:                  # `gearcache ls | head`
        sys.stdout = open(os.devnull, "w")
        return OK
