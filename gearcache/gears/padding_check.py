"""What gearcache does with a gear plan's padding report (padding.py): refuse what it cannot prove, or trust; and
the opt-in test of the analysis against eager.

``inference_config.padding_check``:

* ``"refuse"`` (default): the analysis is the gate. A gear plan with an unsafe write (padding would spread into a
  parameter, a buffer or an unpadded input) or with mixing (an op the analysis cannot prove exact under padding, with
  the pad values it chose) is refused when it is built or loaded (:func:`apply`, ``PaddingUnsafeError``), before
  anything compiles or runs. The reason holds for every call, device and dtype: it comes from the graph, not data.
* ``"verify"``: as ``"refuse"``, and each gear is also tested (:func:`verify`) before it first serves a padded call
  (every gear at ``warmup()``): a test of the analysis, never the gate.
* ``"off"``: nothing is refused or tested (the user asserts that padding is exact).

**The test** runs the eager method twice on the same real-size inputs, on a float64 copy of the module with float64
inputs: padded up to the gear as a call through the gear is (the plan's own pad values; outputs cut back, written
padded inputs copied back), and unpadded; each on copies of the inputs the method writes, with the parameters and
buffers it writes restored after each run. In float64 a size-dependent kernel's rounding (a bf16 GEMM at M=3 and M=4)
is ~1e-16 of a value, so the comparison's tolerance (1e-9 relative; one unit in the last place for a value the method
itself rounds to a narrower dtype) is never reached by rounding, and any effect of the padding rows is. It runs on the
inputs it is given (``warmup()``'s example narrowed to the smallest real sizes of the gear, or the first padded
call's), then once more with the real rows of every floating-point padded input replaced by seeded random numbers. A
difference means the analysis proved something false: ``PaddingUnsafeError`` says so (a gearcache bug to report). A
gear passes once per process (``GearPlan.verified``); ``counters.padding_verifications`` counts the gears tested.
"""
from __future__ import annotations

import copy
import logging
import types
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from ..call import signature
from ..counters import counters
from ..errors import PaddingUnsafeError
from .pad_values import describe as describe_pad
from .plan import narrowed

if TYPE_CHECKING:
    from .plan import GearPlan
    from .padding_report import PaddingReport

log = logging.getLogger("gearcache")

NEUTRAL_PAD_FIX = ("make that op exact under padding: a reduction over the gear dim needs its input's padded rows to "
                   "hold its neutral value (0 before a sum, 1 before a product, +inf before a min, -inf before a max "
                   "or softmax): leave pad_value unset so that gearcache chooses it, or mask the padded rows yourself "
                   "(e.g. pass a mask and use x.masked_fill(~mask, float('inf')).amin(0)); a mean or a variance over "
                   "the gear dim is never exact: compute it outside the cached method, or drop the gears "
                   "of that dim (inference_config.padding_check='off' serves it unchecked)")
WRITE_FIX = ("do that write outside the cached method (return what to write and write it after the call), or pass "
             "the written tensor as an argument with the same gears (gearcache copies its real rows back after each "
             "call), or drop the gears of that dim")
_F64_TOLERANCE = (1e-9, 1e-12)           # (rtol, atol relative to the reference's largest finite magnitude)


def apply(name: str, gear_plan: GearPlan, policy: str) -> None:
    """Refuse what ``policy`` refuses (see the module docstring); mark ``gear_plan`` for the test where it tests."""
    report = gear_plan.padding
    gear_plan.verify_first = False
    if policy == "off":
        return
    if report.unsafe_writes:
        f = report.unsafe_writes[0]
        raise PaddingUnsafeError(
            f"{name}: padding a call up to its gear would change state: {f.op} at {f.where or '(source unknown)'} "
            f"{f.why}, into {f.reaches}; eager writes only the real rows"
            f"{_more(report.unsafe_writes)}. Fix: {WRITE_FIX}")
    if report.mixing:
        raise PaddingUnsafeError(
            f"{name}: padding a call up to its gear may change its results: {describe(report.mixing)}"
            f"{pads_text(gear_plan)}. A geared method is served only where padding is proved exact from its graph "
            f"(docs/DESIGN.md, 'Padding analysis'). Fix: {NEUTRAL_PAD_FIX}")
    gear_plan.verify_first = policy == "verify"


def pads_text(gear_plan: GearPlan) -> str:
    """`` (pad values: x=+inf, ids=0)`` for a message, or ``""``."""
    seen: dict[str, str] = {}
    for d in gear_plan.dims:
        if d.pad_value is not None:
            seen.setdefault(d.name, describe_pad(d.pad_value))
    return f" (pad values: {', '.join(f'{k}={v}' for k, v in seen.items())})" if seen else ""


def real_sizes(gear_plan: GearPlan, sizes: list[int]) -> list[int]:
    """Per marked dim, the smallest real size that pads up to gear ``sizes`` (1 below the smallest gear)."""
    return [max([s for s in d.sizes if s < g], default=0) + 1 for d, g in zip(gear_plan.dims, sizes)]


def cases(gear_plan: GearPlan, leaves: tuple[Any, ...]) -> Iterator[tuple[list[int], tuple[Any, ...]]]:
    """A warm-up's tests: for every gear that a smaller real size pads up to and that has not passed yet, its sizes
    and the example call ``leaves`` narrowed to the smallest real sizes that pad up to it (:func:`real_sizes`)."""
    for sizes in gear_plan.combinations():
        real = real_sizes(gear_plan, sizes)
        if real != sizes and tuple(sizes) not in gear_plan.verified:
            yield sizes, gear_plan.pad(narrowed(leaves, gear_plan.dims, real), real)


def verify(name: str, method: Callable[..., Any], module: torch.nn.Module, gear_plan: GearPlan, structure: Any,
           leaves: tuple[Any, ...], sizes: list[int]) -> None:
    """Test gear ``sizes`` against eager on the real-size call ``leaves`` in float64 (see the module docstring);
    raise ``PaddingUnsafeError`` if padding changes an output or a written tensor."""
    counters.padding_verifications += 1
    real = [leaves[d.leaf].shape[d.dim] for d in gear_plan.dims]
    wide_module, wide_method = _float64(module, method)
    for k, run in enumerate((leaves, _random_rows(gear_plan, leaves))):
        if run is None:
            continue
        try:
            diff = _compare(wide_method, wide_module, gear_plan, structure, _wide(run), sizes)
        except Exception as exc:                # noqa: BLE001 - random rows may be invalid input: only the given run
            if k == 0:
                raise
            log.info("%s: gear %s tested on the given inputs only: random rows raise %s: %s", name, sizes,
                     type(exc).__name__, exc)
            continue
        if diff is not None:
            what, detail = diff
            raise PaddingUnsafeError(
                f"{name}: the padding analysis proved gear {sizes} exact{pads_text(gear_plan)}, but padding changes "
                f"{what} when the method runs eagerly in float64 (real sizes {real}"
                f"{'' if k == 0 else ', random rows'}: {detail}). That is a bug of gearcache's padding analysis: "
                f"please report it with this message. Meanwhile, drop the gears of that dim")
    gear_plan.verified.add(tuple(sizes))


def _float64(module: torch.nn.Module, method: Callable[..., Any]) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """A float64 copy of ``module`` and ``method`` bound to it (the test never touches the served module)."""
    wide = copy.deepcopy(module).to(torch.float64)
    func = getattr(method, "__func__", None)
    bound = types.MethodType(func, wide) if func is not None and getattr(method, "__self__", None) is module else method
    return wide, bound


def _wide(leaves: tuple[Any, ...]) -> tuple[Any, ...]:
    """``leaves`` with every floating-point tensor as a float64 copy."""
    return tuple(x.to(torch.float64, copy=True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                 for x in leaves)


def _compare(method: Callable[..., Any], module: torch.nn.Module, gear_plan: GearPlan, structure: Any,
             leaves: tuple[Any, ...],
             sizes: list[int]) -> tuple[str, str] | None:
    """Run eager padded and unpadded; the first ``(what, how)`` that differs, or None."""
    report = gear_plan.padding
    state = _written_state(module, report)
    saved = [t.clone() for _, t in state]
    try:
        padded_run = _run_padded(method, gear_plan, structure, leaves, sizes, report.written_leaves)
        padded_state = [t.clone() for _, t in state]
        _restore(state, saved)
        copies = _copies(leaves, report.written_leaves)
        eager_run = (_cloned(_run(method, structure, copies), {}), copies)
        eager_state = [t.clone() for _, t in state]
    finally:
        _restore(state, saved)
    for j, (a, b) in enumerate(zip(padded_run[0], eager_run[0])):
        how = _difference(a, b)
        if how is not None:
            return f"output {j}", how
    for i in report.written_leaves:
        how = _difference(padded_run[1][i], eager_run[1][i])
        if how is not None:
            return f"argument leaf {i} (written in place)", how
    for (state_name, _), a, b in zip(state, padded_state, eager_state):
        how = _difference(a, b)
        if how is not None:
            return f"parameter or buffer {state_name} (written in place)", how
    return None


def _run_padded(method: Callable[..., Any], gear_plan: GearPlan, structure: Any, leaves: tuple[Any, ...],
                sizes: list[int], written: list[int]) -> tuple[list[Any], tuple[Any, ...]]:
    """The eager method on ``leaves`` padded to ``sizes``, as a call through the gear sees it: outputs cut back,
    written padded inputs copied back into copies of the caller's; returns ``(outputs, leaf copies)``."""
    copies = _copies(leaves, written)
    padded = gear_plan.pad(copies, sizes)
    flat = _run(method, structure, padded)
    gear_plan.copy_back(padded, copies)
    outs = _cloned(flat, {id(p): c for p, c in zip(padded, copies) if isinstance(p, torch.Tensor)})
    for j, cuts in gear_plan.cuts.items():
        for dim, m in cuts:
            d = gear_plan.dims[m]
            if j < len(outs) and isinstance(outs[j], torch.Tensor):
                outs[j] = outs[j].narrow(dim, 0, copies[d.leaf].shape[d.dim])
    return outs, copies


def _run(method: Callable[..., Any], structure: Any, leaves: tuple[Any, ...]) -> list[Any]:
    """The eager method called on the flat ``leaves`` (rebuilt into its arguments by the key's ``structure``): its
    flattened outputs."""
    args, kwargs = signature.unflatten(structure, leaves)
    flat: list[Any] = []
    signature.flatten(method(*args, **kwargs), flat)
    return flat


def _cloned(flat: list[Any], back: dict[int, torch.Tensor]) -> list[Any]:
    """Flattened outputs, cloned; an output that is a (padded) input is the caller's tensor instead, as the gear's
    result builds it."""
    return [back.get(id(o), o).clone() if isinstance(o, torch.Tensor) else o for o in flat]


def _copies(leaves: tuple[Any, ...], written: list[int]) -> tuple[Any, ...]:
    return tuple(x.clone() if i in written and isinstance(x, torch.Tensor) else x for i, x in enumerate(leaves))


def _written_state(module: torch.nn.Module, report: PaddingReport) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers the method writes (every buffer if the graph could not be analysed)."""
    named = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    names = report.written_state if report.complete else [n for n, _ in module.named_buffers(remove_duplicate=False)]
    return [(n, named[n]) for n in names if n in named]


def _restore(state: list[tuple[str, torch.Tensor]], saved: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for (_, t), old in zip(state, saved):
            t.copy_(old)


def _random_rows(gear_plan: GearPlan, leaves: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``leaves`` with every floating-point padded input replaced by seeded random numbers; None if there is none."""
    floating = sorted({d.leaf for d in gear_plan.dims if leaves[d.leaf].is_floating_point()})
    if not floating:
        return None
    generator = torch.Generator().manual_seed(0)
    new = list(leaves)
    for i in floating:
        x = leaves[i]
        new[i] = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device, x.dtype)
    return tuple(new)


def _difference(a: Any, b: Any) -> str | None:
    """How ``a`` (padded) differs from ``b`` (eager) beyond float64 rounding; None if it does not. A float64 value:
    beyond 1e-9 of it; a narrower float (the method rounded it itself): beyond one unit in its last place; anything
    else: not equal."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None if a == b else f"{a!r} vs eager {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype}{list(a.shape)} vs eager {b.dtype}{list(b.shape)}"
    if not a.is_floating_point():
        return None if torch.equal(a, b) else "the values differ"
    eps = torch.finfo(a.dtype).eps
    rtol, atol = _F64_TOLERANCE if a.dtype == torch.float64 else (eps, eps)
    x, y = a.double(), b.double()
    finite = y[torch.isfinite(y)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    if torch.isclose(x, y, rtol=rtol, atol=atol * scale, equal_nan=True).all():
        return None
    diff = (x - y).abs().nan_to_num(nan=float("inf"))
    return f"max abs diff {float(diff.max()):.3g}"


def describe(found: Sequence[object]) -> str:
    """The first findings, for a message."""
    return "; ".join(str(f) for f in found[:3]) + _more(found)


def _more(found: Sequence[object]) -> str:
    return f" (and {len(found) - 3} more)" if len(found) > 3 else ""
