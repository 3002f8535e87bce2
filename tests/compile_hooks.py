"""Counters on torch's compiler entry points, for proving in a fresh process that nothing was traced or compiled.

``install()`` wraps, for the life of the process (test subprocesses only):

* ``dynamo_frames``: ``torch._dynamo.symbolic_convert.InstructionTranslator.__init__`` (a frame being traced);
* ``guard_builds``: ``torch._dynamo.guards.CheckFunctionManager.__init__`` (guards built: none built, none evaluated);
* ``inductor_compiles``: ``torch._inductor.compile_fx.compile_fx`` and ``compile_fx_inner``;
* ``inductor_codegen``: ``torch._inductor.graph.GraphLowering.codegen``;
* ``cpp_builds``: ``torch._inductor.cpp_builder.CppBuilder.build`` (every g++ run Inductor starts);
* ``triton_compiles``: ``triton.compiler.compiler.compile`` when triton is installed.
"""
from __future__ import annotations

import functools

COUNTS = {"dynamo_frames": 0, "guard_builds": 0, "inductor_compiles": 0,
          "inductor_codegen": 0, "cpp_builds": 0, "triton_compiles": 0}


def _count(owner, name: str, counter: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        COUNTS[counter] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def install() -> None:
    import torch._dynamo.guards as guards
    import torch._dynamo.symbolic_convert as symbolic_convert
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.cpp_builder as cpp_builder
    import torch._inductor.graph as graph

    _count(symbolic_convert.InstructionTranslator, "__init__", "dynamo_frames")
    _count(guards.CheckFunctionManager, "__init__", "guard_builds")
    _count(compile_fx, "compile_fx", "inductor_compiles")
    _count(compile_fx, "compile_fx_inner", "inductor_compiles")
    _count(graph.GraphLowering, "codegen", "inductor_codegen")
    _count(cpp_builder.CppBuilder, "build", "cpp_builds")
    try:
        import triton.compiler.compiler as triton_compiler
    except ImportError:
        return
    _count(triton_compiler, "compile", "triton_compiles")
    import triton

    triton.compile = triton_compiler.compile
