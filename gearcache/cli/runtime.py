"""``gearcache warmup`` (compile or load every gear of a model's cached methods) and ``gearcache native`` (the
dispatch shortcut's native checks for this torch)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import CliError
from .output import FAILED, OK, emit, format_table

if TYPE_CHECKING:
    from ..cached_function import CachedFunction


# ======================================================================================================== warmup
def load_factory(spec: str) -> Callable[[], Any]:
    """The callable ``MODULE:FACTORY`` names (the current folder on ``sys.path``); ``CliError`` naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:make_model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"cannot import {module_name!r} ({exc}); run from the folder that holds it or install "
                       f"it") from None
    except Exception as exc:
        raise CliError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliError(f"{spec} is not callable")
    factory: Callable[[], Any] = obj
    return factory


def _made(spec: str) -> tuple[Any, tuple[Any, ...] | list[Any], dict[str, Any]]:
    """``FACTORY()``'s ``(model, example_args, example_kwargs)``, checked."""
    import torch

    try:
        made = load_factory(spec)()
    except CliError:
        raise
    except Exception as exc:
        raise CliError(f"{spec}() raised {type(exc).__name__}: {exc}", FAILED) from exc
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise CliError(f"{spec}() must return (model, example_args) or (model, example_args, example_kwargs); "
                       f"got {type(made).__qualname__}")
    model, example_args = made[0], made[1]
    example_kwargs = made[2] if len(made) == 3 else {}
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    if not isinstance(example_args, (tuple, list)) or not isinstance(example_kwargs, dict):
        raise CliError(f"{spec}(): example_args must be a tuple and example_kwargs a dict")
    return model, example_args, example_kwargs


def _warm_one(name: str, cf: CachedFunction, args: tuple[Any, ...] | list[Any],
              kwargs: dict[str, Any]) -> dict[str, Any]:
    """Warm up one cached method (progress on stderr); its row, with ``"error"`` when it failed."""
    import torch

    from ..counters import counters

    print(f"gearcache warmup: {name} ({cf.name}) ...", file=sys.stderr, flush=True)
    before, t0 = counters.snapshot(), time.perf_counter()
    try:
        with torch.inference_mode():
            n = cf.warmup(*args, **kwargs)
    except Exception as exc:
        print(f"gearcache warmup: {name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {"attribute": name, "method": cf.name, "gears": None, "error": f"{type(exc).__name__}: {exc}",
                "cache_dir": str(cf.store.root)}
    dt, delta = time.perf_counter() - t0, counters.delta(before)
    print(f"gearcache warmup: {name}: {n} gear(s) in {dt:.2f} s ({delta['compiles']} compiled, "
          f"{delta['loads']} loaded)", file=sys.stderr, flush=True)
    return {"attribute": name, "method": cf.name, "gears": n, "seconds": round(dt, 3),
            "compiled": delta["compiles"], "loaded": delta["loads"], "cache_dir": str(cf.store.root)}


def cmd_warmup(args: argparse.Namespace) -> int:
    from ..cached_function import CachedFunction

    if args.cache_dir:
        os.environ["GEARCACHE_HOME"] = str(args.cache_dir)   # for cache_compile(..., cache_dir=None) in the factory
    model, example_args, example_kwargs = _made(args.factory)
    methods = [(name, value) for name, value in sorted(vars(model).items()) if isinstance(value, CachedFunction)]
    if not methods:
        raise CliError(f"{type(model).__qualname__} has no cache_compile'd attribute (a gearcache.CachedFunction), "
                       f"so there is nothing to warm up")
    rows = [_warm_one(name, cf, example_args, example_kwargs) for name, cf in methods]
    failed = any("error" in r for r in rows)

    def human() -> str:
        return format_table(["ATTRIBUTE", "METHOD", "GEARS", "COMPILED", "LOADED", "SECONDS", "CACHE DIR"], [
            [r["attribute"], r["method"], r["gears"] if r["gears"] is not None else "FAILED", r.get("compiled"),
             r.get("loaded"), f"{r['seconds']:.2f}" if "seconds" in r else None, r["cache_dir"]] for r in rows],
            right=(2, 3, 4, 5))

    emit(args, {"methods": rows, "ok": not failed}, human)
    return FAILED if failed else OK


# ========================================================================================================== native
def cmd_native(args: argparse.Namespace) -> int:
    """``status``: the native checks' folder, key and state; ``build``: build them now (exit 1 if that fails)."""
    from .. import native
    from ..errors import NativeBuildError
    from ..native import build

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
    emit(args, doc, human)
    return OK
