"""Compiling in a worker process (parallel warm-up, gearcache/compiling/workers.py): what crosses the process boundary.

The caller captures; the worker compiles. The Dynamo graph travels as bytes (:func:`graph_to_bytes`: torch's own
``GraphPickler``, which its subprocess compile uses too), the example inputs as metadata, Inductor's and AOTAutograd's
settings as torch's portable config snapshot (:func:`compiler_settings`). The worker runs the first half of
:func:`gearcache._torch.inductor.compile_to_folder` (``compile_unloaded``); the caller runs the second
(``pipeline.finish_artifact``), the run plan's check needing the real example inputs.
"""
from __future__ import annotations

import functools
import pickle
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.fx._graph_pickler import GraphPickler


# node meta kept for placeholders, and the one tensor_dict entry AOTAutograd reads (see graph_to_bytes)
_PLACEHOLDER_META = ("example_value", "stack_trace", "tensor_dict")
_STATIC_INPUT_ATTR = "_dynamo_static_input_type"


def graph_to_bytes(gm: torch.fx.GraphModule) -> bytes:
    """Serialise a Dynamo (or ``make_fx``) graph for :func:`graph_from_bytes` in another process.

    Kept: the nodes with their names, ``stack_trace`` and fake ``example_value`` meta, the module's attributes and
    constants, and what AOTAutograd reads from a Dynamo graph to find the static inputs (placeholders'
    ``_dynamo_source``, ``tensor_dict[_dynamo_static_input_type]``, ``_param_name_to_source``, ``meta``), so the
    compile is the one the calling process would run. Dropped: module stacks (they name the user's classes, which the
    worker may not import) and any other tensor attribute. Raises if the graph holds something torch cannot pickle
    (a call to a user function, say): the caller then compiles it in-process."""
    from torch.fx._graph_pickler import Options
    from torch.fx._lazy_graph_module import _LazyGraphModule

    saved = {}
    for node in gm.graph.nodes:
        saved[node] = dict(node.meta)
        if "tensor_dict" in node.meta:
            node.meta["tensor_dict"] = {k: v for k, v in node.meta["tensor_dict"].items() if k == _STATIC_INPUT_ATTR}
    sources = [getattr(n, "_dynamo_source", None) for n in gm.graph.find_nodes(op="placeholder")]
    try:
        options = Options(ops_filter=None, node_metadata_key_filter=lambda k: k in _PLACEHOLDER_META)
        return pickle.dumps({"graph": _graph_pickler().dumps(gm, options), "sources": sources,
                             "lazy": isinstance(gm, _LazyGraphModule)})
    finally:
        for node, meta in saved.items():
            node.meta = meta


@functools.cache
def _graph_pickler() -> type[GraphPickler]:
    """torch's ``GraphPickler``, also clearing the fake mode of a view's base: torch clears the view's own (its
    unpickler sets both) but not the base's, so a graph with a view among its fake values fails to pickle (2.13)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx._graph_pickler import GraphPickler, _TensorPickleData

    class Pickler(GraphPickler):
        def reducer_override(self, obj: object) -> Any:
            if isinstance(obj, FakeTensor):
                fn, (data, token) = _TensorPickleData.reduce_helper(self, obj)
                if data.metadata.base is not None:
                    base = dataclasses.replace(data.metadata.base, fake_mode=None)
                    data.metadata = dataclasses.replace(data.metadata, base=base)
                return fn, (data, token)
            return super().reducer_override(obj)

    return Pickler


def graph_from_bytes(data: bytes) -> torch.fx.GraphModule:
    """The graph :func:`graph_to_bytes` serialised, its fake tensors in a new fake mode. A Dynamo graph comes back
    as the lazily recompiled kind Dynamo makes (``_LazyGraphModule``): AOTAutograd's cache key hashes the module's
    attributes in the order a copy of it gets them, which differs between the two kinds."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    parts = pickle.loads(data)
    gm = cast(torch.fx.GraphModule, GraphPickler.loads(parts["graph"], FakeTensorMode(shape_env=ShapeEnv())))
    for node, source in zip(gm.graph.find_nodes(op="placeholder"), parts["sources"]):
        if source is not None:
            node._dynamo_source = source
    if parts["lazy"]:
        gm.__class__ = type(_LazyGraphModule.__new__(_LazyGraphModule))     # its own subclass, as every GraphModule
    else:
        gm.recompile()
    return gm


def compiler_settings() -> dict[str, Any]:
    """Inductor's and AOTAutograd's settings in this process (the user may have changed them at run time), for
    :func:`apply_compiler_settings` in a worker: the compile there then runs under the same settings."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return {"inductor": inductor_config.save_config_portable(), "functorch": functorch_config.save_config_portable()}


def apply_compiler_settings(settings: dict[str, Any]) -> None:
    """Load :func:`compiler_settings` of the calling process (worker processes only: it changes them for good)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.load_config(settings["inductor"])
    functorch_config.load_config(settings["functorch"])


def warm_up_compiler() -> None:
    """Import what a compile needs (AOTAutograd, Inductor, ``standalone_compile``) and start Inductor's compile
    pool now (worker processes only: a warm process must not import the compiler)."""
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.standalone_compile  # noqa: F401
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()

