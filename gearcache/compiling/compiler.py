"""Compiling a captured graph into an artifact folder: Inductor's artifact, then its run plan.

``compile_artifact`` is the one entry point every compile goes through (a cached method's entries, the
torch.compile route's backend; warm-up workers run its first half in another process and the caller
:func:`finish_artifact`), so tests can replace it as a whole.
"""
from __future__ import annotations

import pathlib
from typing import Any

import torch

from .._torch import inductor as torch_inductor
from ..runplan import write_run_plan


def compile_artifact(gm: torch.fx.GraphModule, example_inputs: list[Any], folder: pathlib.Path, *,
                     config_patches: dict[str, Any]) -> None:
    """Write the artifact whose Inductor folder is ``folder`` (``<artifact>/inductor``) and its run plan
    (``<artifact>/runplan``; this runs the graph on ``example_inputs``, in-place updates going to copies)."""
    torch_inductor.compile_unloaded(gm, example_inputs, folder, config_patches=config_patches)
    finish_artifact(folder, example_inputs)


def finish_artifact(folder: pathlib.Path, example_inputs: list[Any]) -> None:
    """The second half of :func:`compile_artifact`, for an Inductor folder compiled elsewhere (a warm-up worker
    process, ``_torch.inductor.compile_unloaded``): a first load, then the run plan from the real ``example_inputs``."""
    loaded = torch_inductor.load_folder(folder)
    write_run_plan(pathlib.Path(folder).parent, loaded, example_inputs)
