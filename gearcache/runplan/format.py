"""Constants shared by the run plan's writer and loader (the format itself is described in ``__init__``)."""
from __future__ import annotations

FORMAT = 1
PLAN_DIR = "runplan"
ALIGNMENT = 16          # Inductor compiles kernels assuming 16-byte aligned inputs (torch._inductor.utils.ALIGNMENT)
ALIGN_BYTES = 64        # torch._inductor.utils.ALIGN_BYTES, behind codegen.memory_planning._align
WRAPPER_FILENAME = "<gearcache artifact>/runplan/wrapper.py"      # in tracebacks


class RunPlanUnavailable(RuntimeError):
    """This process cannot run the plan (the wrapper needs something gearcache's loader does not provide)."""


class NoPlan(Exception):
    """The artifact cannot get a run plan (the writer records the reason in the plan)."""


def require(ok: object, why: str) -> None:
    if not ok:
        raise NoPlan(why)
