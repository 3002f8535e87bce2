"""``cache_compile``: the public entry point (torchair's signature, stricter arguments)."""
from __future__ import annotations

import inspect
import types
from typing import Any, Callable, cast

import torch

from .cached_function import CachedFunction
from .config import CompilerConfig
from .errors import ConfigError
from .keys import decompositions as key_decompositions
from .store import Store
from .ranks.topology import resolve_topology


def cache_compile(func: Callable[..., Any], *, config: CompilerConfig | None = None, dynamic: bool = True,
                  cache_dir: str | None = None, global_rank: int | None = None, tp_rank: int | None = None,
                  pp_rank: int | None = None, custom_decompositions: dict[Any, Callable[..., Any]] | None = None,
                  **kwargs: Any) -> CachedFunction:
    """Serve ``func`` (a bound method of an ``nn.Module``) from compiled entries persisted under ``cache_dir``.

    Call it in the module's ``__init__``: ``self.cached_forward = cache_compile(self._forward)``. Nothing is traced or
    compiled until the first call; a process that finds the entry on disk loads it with no compiler.

    ``dynamic``: gearcache compiles one static-shape entry per input signature (shape buckets come from gears,
    ``set_dim_gears``). ``dynamic=True`` (default) lets new signatures add entries as ``config.on_new_signature``
    says; ``dynamic=False`` pins the method to the first signature seen (any other raises).
    """
    if kwargs:
        name = next(iter(kwargs))
        raise ConfigError(f"cache_compile() got an unexpected keyword argument {name!r}={kwargs[name]!r}. Accepted: "
                          f"config, dynamic, cache_dir, global_rank, tp_rank, pp_rank, custom_decompositions")
    _check_method(func)
    if config is None:
        config = CompilerConfig()
    elif not isinstance(config, CompilerConfig):
        raise ConfigError(f"config={config!r}: expected a gearcache.CompilerConfig (or None for the defaults)")
    if not isinstance(dynamic, bool):
        raise ConfigError(f"dynamic={dynamic!r}: expected True or False")
    if not dynamic:
        config = config.model_copy(update={"on_new_signature": "error"})
    custom_decompositions = key_decompositions.checked(custom_decompositions)     # a clear error for one not keyable
    if cache_dir is not None and not isinstance(cache_dir, str) and not hasattr(cache_dir, "__fspath__"):
        raise ConfigError(f"cache_dir={cache_dir!r}: expected a folder path (str or os.PathLike)")
    method = cast(types.MethodType, func)           # _check_method: a bound method of an nn.Module
    return CachedFunction(method, config=config, store=Store.from_config(cache_dir, config),
                          topology=resolve_topology(global_rank, tp_rank, pp_rank),
                          decompositions=custom_decompositions)


def _check_method(func: Any) -> None:
    if isinstance(func, CachedFunction):
        raise ConfigError("func is already a cache_compile'd method; call cache_compile once per method")
    if not inspect.ismethod(func):
        kind = "a lambda" if getattr(func, "__name__", "") == "<lambda>" else type(func).__qualname__
        raise ConfigError(
            f"func={func!r:.80} is {kind}, not a bound method of an nn.Module. Fix: define the computation as a "
            f"method and pass it bound, e.g. self.cached = cache_compile(self._forward) in __init__.")
    if not isinstance(func.__self__, torch.nn.Module):
        raise ConfigError(f"func={func.__qualname__} is a method of {type(func.__self__).__qualname__}, which is not "
                          f"a torch.nn.Module. Fix: make the class subclass torch.nn.Module")
    if func.__name__ == "forward" and any(c.__name__ == "GenerationMixin" for c in type(func.__self__).__mro__):
        raise ConfigError(
            f"func={func.__qualname__}: a transformers model's forward takes a Cache object, which a cached method "
            f"cannot. Fix: gearcache.integrations.transformers.enable(model, cache_dir=...) serves its forward and "
            f"generate() (docs/TRANSFORMERS.md)")
    if getattr(func.__func__, "__wrapped__", None) is not None:
        raise ConfigError(f"func={func.__qualname__} is wrapped by another decorator; gearcache needs the plain "
                          f"method. Fix: apply cache_compile to the undecorated method")
