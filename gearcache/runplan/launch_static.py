"""Triton kernels launched through torch's static CUDA launcher (``torch._C._StaticCudaLauncher``, the launcher
Inductor itself uses): one C++ call per launch, no Python packing of arguments."""
from __future__ import annotations

import builtins
import functools
import pathlib
import types
from typing import Any, Callable

from .._torch import runplan as torch_runplan


def launcher_source(spec: dict[str, Any], launch_line: str) -> str:
    """``def launcher(<def_args>, stream)``: computes the grid from the launch record's expressions (Inductor's own
    ``GridExpr``), then runs ``launch_line`` (which sees ``grid_0..2`` and the call arguments)."""
    return "\n".join([f"def launcher({', '.join([*spec['def_args'], 'stream'])}):",
                      *[f"    {line}" for line in spec["grid_prefix"]],
                      *[f"    grid_{i} = {expr}" for i, expr in enumerate(spec["grid"])],
                      f"    {launch_line}"])


def compile_launcher(name: str, source: str, scope: dict[str, Any]) -> Callable[..., None]:
    """``launcher`` as ``source`` defines it, run in a fresh module scope of ``scope``'s names (its kernel, its launch
    function). The source's code is compiled once per process (:func:`_launcher_code`): a method's gears load the
    same kernels with the same launch records, and compiling each one's launcher again is GIL-bound work a warm
    start's look-ups would serialize on."""
    scope = {**scope, "__builtins__": builtins}
    exec(_launcher_code(name, source), scope)
    launcher: Callable[..., None] = scope["launcher"]
    return launcher


@functools.lru_cache(maxsize=4096)
def _launcher_code(name: str, source: str) -> types.CodeType:
    """The compiled ``source`` (a code object is immutable: each launcher made from it gets its own globals)."""
    return compile(source, f"<gearcache launcher {name}>", "exec")


class StaticLaunch:
    """Stands for Inductor's ``CachingAutotuner`` after autotuning: ``run(*args, stream)`` launches the chosen
    config's cubin with the grid Inductor computes for it."""
    __slots__ = ("run", "_function")

    def __init__(self, name: str, spec: dict[str, Any], folder: pathlib.Path, device_index: int):
        self._function = torch_runplan.load_cubin(str(folder / spec["cubin"]), spec["function"], spec["shared"],
                                           device_index)
        args = [*spec["call_args"], *(["None"] * spec["scratch_args"])]
        line = (f"launch(function, grid_0, grid_1, grid_2, {int(spec['num_warps'])}, {int(spec['shared'])}, "
                f"{spec['arg_types']!r}, ({', '.join(args)},), stream)")
        self.run = compile_launcher(name, launcher_source(spec, line),
                                    {"launch": torch_runplan.cubin_launcher(), "function": self._function})
