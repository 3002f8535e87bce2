"""Regional compilation: a model's repeated blocks compiled once per distinct block and input signature (gear), each
compiled entry reused by every block of that kind, in this model and in any other whose block is the same.

    from gearcache import compile_blocks

    regions = compile_blocks(model, cache_dir="/srv/gearcache")     # every repeated block's forward, cached
    model(x)                                                        # the glue between blocks runs eagerly

Each block instance's ``forward`` becomes a cached method (a :class:`~gearcache.cached_function.CachedFunction` of
``type(block).forward`` bound to that block). Its parameters and buffers are graph inputs read from the block at
every call, never constants, and the entry key is made of what the compiled code depends on (the method's name and
source, the block's parameter and buffer layout, the call's signature, the config and environment), so identical
blocks have one key: the first block to miss captures and compiles the entry and publishes it; every other block
finds that entry in the store, checks its value guards against itself (a block whose Python attributes change the
code, ``self.use_bias``, gets an entry of its own), and shares the one load this process made of the artifact
(``ArtifactPipeline.shares_loads``). A block class with another forward, another parameter layout or another
class's submodules has another key or fails the entry's guards and dependencies, so it compiles its own.

Which blocks: ``blocks`` (classes) when given, else every class of which some ``nn.ModuleList``/``nn.Sequential``
holds two or more instances (a model's layers), outermost first (a block inside a chosen block runs inside its
graph). Blocks with forward hooks are refused (the hooks would run inside the compiled graph's trace only once).
:meth:`Regions.remove` restores the blocks' own forwards. A block class whose ``forward`` is replaced after
``compile_blocks`` (a library's patch) serves the new forward from entries of its own (:class:`BlockForward`).

The whole-graph alternative is ``cache_compile`` on the model's own method: one graph, fused across blocks (fewer
launches and no per-block call: faster per call), compiled per gear with a time that grows with the layer count.
docs/CONFIG.md ("Regions") says when each is chosen.
"""
from __future__ import annotations

import copy
import types
from collections import abc
from typing import Any, Callable, Iterable, Sequence

import torch

from ._torch import nn_modules as torch_nn_modules
from .cached_function import CachedFunction
from .config import CompilerConfig
from .errors import ConfigError
from .ranks.topology import Topology, resolve_topology
from .store import Store


class Regions:
    """The blocks :func:`compile_blocks` serves: ``blocks`` (instances, model order), ``cached`` (their cached
    methods, same order), ``kinds`` (the distinct block classes)."""

    def __init__(self, blocks: list[torch.nn.Module], cached: list[CachedFunction]):
        self.blocks = blocks
        self._cached = cached
        self.kinds = list(dict.fromkeys(type(b) for b in blocks))

    @property
    def cached(self) -> list[CachedFunction]:
        """Each block's cached method now (a :class:`BlockForward` replaced after its class's ``forward`` was)."""
        now = [b.__dict__.get("forward") for b in self.blocks]
        return [f if isinstance(f, BlockForward) else c for f, c in zip(now, self._cached)]

    def remove(self) -> None:
        """Restore every block's own ``forward``."""
        for block in self.blocks:
            block.__dict__.pop("forward", None)

    def __repr__(self) -> str:
        names = ", ".join(k.__qualname__ for k in self.kinds)
        return f"<gearcache.Regions {len(self.blocks)} blocks of {len(self.kinds)} kinds: {names}>"


def compile_blocks(model: torch.nn.Module, *, cache_dir: str | None = None, config: CompilerConfig | None = None,
                   blocks: Sequence[type] | None = None, global_rank: int | None = None,
                   tp_rank: int | None = None, pp_rank: int | None = None) -> Regions:
    """Serve the forward of each repeated block of ``model`` from compiled entries shared by identical blocks (see
    the module docstring); returns the :class:`Regions`. ``blocks``: the block classes (default: found)."""
    config, blocks = _checked(model, cache_dir, config, blocks)
    chosen = find_blocks(model, blocks)
    if not chosen and blocks is not None:
        kinds = ", ".join(k.__qualname__ for k in blocks)
        raise ConfigError(f"compile_blocks(model={type(model).__qualname__}, blocks=[{kinds}]): the model holds no "
                          f"module of these classes below it. Fix: pass the classes of its repeated blocks")
    if not chosen:
        raise ConfigError(f"compile_blocks(model={type(model).__qualname__}): no repeated blocks (no ModuleList or "
                          f"Sequential holds two modules of one class). Fix: pass blocks=[YourBlock], or "
                          f"cache_compile the model's forward")
    names = {id(m): name for name, m in model.named_modules()}
    for block in chosen:        # every block checked before any is served: a refusal leaves the model as it was
        check_block(block, names.get(id(block), ""))
    store = Store.from_config(cache_dir, config)
    topology = resolve_topology(global_rank, tp_rank, pp_rank)
    cached = [serve_block(block, config=config, store=store, topology=topology) for block in chosen]
    return Regions(chosen, cached)


def _checked(model: Any, cache_dir: Any, config: Any, blocks: Any) -> tuple[CompilerConfig, tuple[type, ...] | None]:
    """``compile_blocks``' arguments checked (``ConfigError`` naming the argument, its value and the fix); returns
    the config (the defaults for None) and the block classes (None: found)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"compile_blocks(model={type(model).__qualname__}): expected a torch.nn.Module (the model "
                          f"whose repeated blocks are compiled)")
    if cache_dir is not None and not isinstance(cache_dir, str) and not hasattr(cache_dir, "__fspath__"):
        raise ConfigError(f"cache_dir={cache_dir!r}: expected a folder path (str or os.PathLike)")
    if blocks is not None:
        if isinstance(blocks, (type, str, torch.nn.Module)) or not isinstance(blocks, abc.Iterable):
            name = blocks.__qualname__ if isinstance(blocks, type) else "YourBlock"
            raise ConfigError(f"blocks={blocks!r:.80}: expected a list of block classes. Fix: blocks=[{name}]")
        blocks = tuple(blocks)
        for item in blocks:
            if not (isinstance(item, type) and issubclass(item, torch.nn.Module)):
                what = repr(item) if isinstance(item, type) else f"a {type(item).__qualname__} instance"
                name = type(item).__qualname__ if isinstance(item, torch.nn.Module) else "YourBlock"
                raise ConfigError(f"blocks: {what:.80} is not an nn.Module class. Fix: blocks=[{name}] (the class)")
    if config is None:
        config = CompilerConfig()
    elif not isinstance(config, CompilerConfig):
        raise ConfigError(f"config={config!r}: expected a gearcache.CompilerConfig (or None for the defaults)")
    if config.mode == "reduce-overhead":
        raise ConfigError("compile_blocks(): mode='reduce-overhead' captures CUDA graphs per cached method, which "
                          "for blocks would be a graph per block. Fix: cache_compile the model's whole step for graphs")
    return config, blocks


class BlockForward(CachedFunction):
    """A block's ``forward`` served by region (its instance attribute): the cached method of the ``forward`` its class
    had when served. A class whose ``forward`` is replaced later (a patch after ``compile_blocks``) is seen by the
    entries' guard watch (the class of a module on a guard's path is watched), which sends the call here: it is
    handed to the cached method of the new ``forward``, installed in this one's place; the old forward's entries
    never serve it."""

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(type(self._module), "forward", None) is not self._method.__func__:
            return self._successor()(*args, **kwargs)
        return super()._call(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, object]) -> CachedFunction:
        """``copy.deepcopy(model)``: the copied block's own ``BlockForward``, as :func:`serve_block` builds it."""
        return block_function(copy.deepcopy(self._module, memo), self._method.__name__, config=self.config,
                              store=self.store, topology=self.topology)

    def __reduce__(self) -> tuple[Callable[..., CachedFunction], tuple[object, ...]]:
        """``pickle`` / ``torch.save(model)``: rebuilt as :func:`serve_block` builds it, from the store's folder."""
        return _unpickle_block, (self._module, self._method.__name__, self.config, str(self.store.root),
                                 self.topology)

    def _successor(self) -> CachedFunction:
        block = self._module
        installed = block.__dict__.get("forward") is self
        if installed:
            del block.__dict__["forward"]
        successor = serve_block(block, config=self.config, store=self.store, topology=self.topology)
        if not installed:
            del block.__dict__["forward"]
        return successor


def serve_block(block: torch.nn.Module, *, config: CompilerConfig, store: Store, topology: Topology,
                method: str = "forward") -> CachedFunction:
    """One block's cached method (``type(block).<method>`` bound to it), sharing loads of identical artifacts; for
    ``forward``, installed as the block's ``forward`` (what ``block(...)`` calls)."""
    check_block(block)
    cf = block_function(block, method, config=config, store=store, topology=topology)
    if method == "forward":
        block.__dict__["forward"] = cf
    return cf


def check_block(block: torch.nn.Module, where: str = "") -> None:
    """``ConfigError`` for a block that cannot be served by region (``where``: its name in the model)."""
    named = f"block {where} ({type(block).__qualname__})" if where else f"block {type(block).__qualname__}"
    if torch_nn_modules.has_forward_hooks(block):
        raise ConfigError(f"{named} has forward hooks, which regional compilation cannot place. Fix: remove them, "
                          f"or cache_compile the whole model")
    if "forward" in block.__dict__:
        raise ConfigError(f"{named}: its forward is already replaced (served by gearcache or another wrapper). "
                          f"Fix: Regions.remove() first")


def block_function(block: torch.nn.Module, method: str, *, config: CompilerConfig, store: Store,
                   topology: Topology) -> CachedFunction:
    """The cached method :func:`serve_block` installs (a :class:`BlockForward` for ``forward``), not installed."""
    bound = types.MethodType(getattr(type(block), method), block)
    kind = BlockForward if method == "forward" else CachedFunction
    cf = kind(bound, config=config, store=store, topology=topology, decompositions=None)
    cf.life.pipeline.shares_loads = True
    cf.sizes_chosen_by_caller()         # one entry per block input signature is the design
    return cf


def _unpickle_block(block: torch.nn.Module, method: str, config: CompilerConfig, root: str,
                    topology: Topology) -> CachedFunction:
    """Rebuild a pickled :class:`BlockForward` (only the block's class is read: pickle sets its state later)."""
    return block_function(block, method, config=config, store=Store.from_config(root, config), topology=topology)


def find_blocks(model: torch.nn.Module, classes: Iterable[type] | None = None) -> list[torch.nn.Module]:
    """The blocks to compile by region, in model order: instances of ``classes`` when given, else of every class
    that some ``ModuleList``/``Sequential`` holds two or more of; outermost only."""
    wanted = tuple(classes) if classes is not None else None
    if wanted is None:
        found: set[type] = set()
        for module in model.modules():
            if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
                kinds = [type(m) for m in module]
                found |= {k for k in kinds if kinds.count(k) >= 2}
        wanted = tuple(found)
    chosen: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():          # pre-order: a block comes before its submodules
        if id(module) in inside or module is model:
            continue
        if type(module) in wanted:
            chosen.append(module)
            inside |= {id(m) for m in module.modules()}
    return chosen
