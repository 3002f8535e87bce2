"""Constants shared by the run plan's writer and loader (the format itself is described in ``__init__``)."""
from __future__ import annotations

from ..errors import NoPlan

FORMAT = 1
PLAN_DIR = "runplan"
ALIGNMENT = 16          # Inductor compiles kernels assuming 16-byte aligned inputs (torch._inductor.utils.ALIGNMENT)
ALIGN_BYTES = 64        # torch._inductor.utils.ALIGN_BYTES, behind codegen.memory_planning._align
WRAPPER_FILENAME = "<gearcache artifact>/runplan/wrapper.py"      # in tracebacks


def require(ok: object, why: str) -> None:
    """Raise :class:`~gearcache.errors.NoPlan` (the writer records ``why`` as the plan's reason) unless ``ok``."""
    if not ok:
        raise NoPlan(why)
