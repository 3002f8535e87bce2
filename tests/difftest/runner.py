"""Run one generated case against its eager twin, call by call (self-contained: stdlib, torch and gearcache only, so
that a reproducer script embeds this file as it is).

A case (JSON, made by ``draw.py``)::

    {"id": 7, "seed": 1234, "device": "cpu",
     "program": {"module": "dtp_3", "helper": "dth_3", "inputs": ["x", "state", "alpha"]},
     "attrs": {"eps": 0.1},                 # constructor arguments (the rest take their defaults)
     "assign": {"SCALE": 3.0},              # module constants set in this process before the model is built
     "options": {"route": "cache_compile" | "torch_compile", "dynamic": true, "decompositions": null | "addmm",
                 "gears": null | {"sizes": [2, 4], "declare": "marks" | "by_name", "policy": "zip" | "product",
                                  "pad": 0.0 | None},     # None: gearcache chooses the pad
                 "past_largest": "error" | "eager" | "compile", "warmup": false, "verify_padding": false,
                 "mode": "default" | "reduce-overhead", "graph_outputs": "copy", "capture_graphs": "warmup",
                 "static_address": false, "dtype": "float32" | "bfloat16"},   # dtype: the model's and x's
     "mask": true,                          # the optional input is a tensor on every call (else None)
     "change": {"kind": "class_patch", "when": "before" | "after"},    # optional: CHANGES, before call 0 / 1
     "calls": [{"B": 3, "noncontig": ["x"], "alpha": 0.5, "n": 1, "data": "positive"}, ...]}

A call's ``data`` (absent: random values as drawn) shapes the values of ``x``, ``y``, ``state`` and ``ids``:
``"mixed"`` keeps them random (and makes ``ids``' first row 0), ``"positive"`` makes every float above 0.5 and every
id 5 or more, ``"negative"`` every float below -0.5 and every id below 5: a pad value wrong for a min or a max shows on
such a call, where the mixed first call hides it.

:func:`run_case` builds the model and its **twin** (a deep copy made before compiling: same weights, same buffers),
compiles the model's ``fwd`` on the case's route, then for each call makes the inputs twice (same values and
strides), runs the twin's ``fwd`` eagerly and the compiled one, and compares every output leaf, every input tensor
(updated in place or not) and every buffer and parameter. ``warmup`` is checked too: it must leave the module and
the persistent input as they were. Outcomes: ``equal``; ``refused`` (the compiled side raised a gearcache error, a
clear refusal: the case stops there); ``mismatch`` (a value, shape, dtype or structure differs); ``crash`` (the
compiled side raised anything else); ``invalid`` (the eager twin itself raised: a generator bug).
"""
import contextlib
import copy
import math
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import torch

import gearcache
from gearcache import CompilerConfig, counters

ROWS, D = 8, 16
ORACLE_CHECKS = {"left": 10}    # mismatches checked against plain torch.compile per process (each check compiles)
CASE_DTYPE: dict[str, Any] = {"dtype": None}    # the running case's model dtype: its rounding bounds every float
COUNTED = ("compiles", "loads", "traces", "misses", "hits", "pads", "eager_calls", "graph_captures")


# ------------------------------------------------------------------------------------------------ decompositions
def addmm_decomposition(input, mat1, mat2, *, beta=1, alpha=1):
    """``aten.addmm`` as a matmul and an add: equal to it up to rounding."""
    return input * beta + (mat1 @ mat2) * alpha


def addmm_without_bias(input, mat1, mat2, *, beta=1, alpha=1):
    """A *wrong* decomposition (drops the bias): the known-bad setup the tester's own tests use."""
    return (mat1 @ mat2) * alpha


def decompositions(name: str | None) -> dict | None:
    if name is None:
        return None
    fn = {"addmm": addmm_decomposition, "addmm_without_bias": addmm_without_bias}[name]
    return {torch.ops.aten.addmm.default: fn}


# --------------------------------------------------------------------------------------------------- programs
def load_program(src_dir: str | Path, program: dict) -> types.ModuleType:
    """Import the program file (and its helper) from ``src_dir`` by executing its source, never a ``.pyc``: a file
    rewritten in the same second with the same size must not run its old bytecode. Reloaded when the file changed."""
    src_dir = Path(src_dir)
    names = [n for n in (program.get("helper"), program["module"]) if n and (src_dir / f"{n}.py").is_file()]
    module = None
    for name in names:
        path = src_dir / f"{name}.py"
        text = path.read_text()
        module = sys.modules.get(name)
        if module is None or getattr(module, "__difftest_source__", None) != (str(path), text):
            module = types.ModuleType(name)
            module.__file__ = str(path)
            module.__difftest_source__ = (str(path), text)
            sys.modules[name] = module
            exec(compile(text, str(path), "exec"), module.__dict__)     # noqa: S102 - the generated program
    return module


@contextlib.contextmanager
def assigned(program: dict, assign: dict):
    """Set module constants for the block (``"SCALE"`` in the program module; ``"helper.X"`` in the helper module and,
    where the program imported it by name, in the program module), then restore them."""
    module, helper = sys.modules[program["module"]], sys.modules.get(program.get("helper") or "")
    saved = []
    for name, value in assign.items():
        if name.startswith("closure."):             # a variable of the factory the class is built in: rebound
            name = name[len("closure."):]
            saved.append((module, f"set_{name}", getattr(module, f"get_{name}")()))
            getattr(module, f"set_{name}")(value)
            continue
        targets = [(module, name)]
        if name.startswith("helper."):
            name = name[len("helper."):]
            targets = [(helper, name)] + ([(module, name)] if hasattr(module, name) else [])
        for owner, attr in targets:
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, value)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            if attr.startswith("set_"):
                getattr(owner, attr)(value)
            else:
                setattr(owner, attr, value)


# ---------------------------------------------------------------------------------------------------- changes
# Issue #35's changes to a model, applied to the model and its twin alike, before the first call or after it:
# kind -> (blocks the program needs (any of), the change: (model, twin, program module) -> undo or None)
def _patched_helper(self, h):
    return h * 0.5 - 1.0


def _class_patch(model, twin, module):
    cls = type(model)
    old = cls.__dict__["helper"]
    cls.helper = _patched_helper
    return lambda: setattr(cls, "helper", old)


def _instance_patch(model, twin, module):
    for m in (model, twin):
        m.helper = types.MethodType(_patched_helper, m)


CLOSURE_REBOUND = 7.0


def _closure_rebind(model, twin, module):
    old = module.get_CSCALE()
    module.set_CSCALE(CLOSURE_REBOUND)
    return lambda: module.set_CSCALE(old)


def _submodule(model, twin, module):
    lin = torch.nn.Linear(D, D).to(model.lin.weight.device, model.lin.weight.dtype)   # a bfloat16 model's dtype
    with torch.no_grad():
        lin.weight.copy_(torch.linspace(-1, 1, D * D).view(D, D))
    model.lin, twin.lin = lin, copy.deepcopy(lin)


def _hook(model, twin, module):
    for m in (model, twin):
        m.lin.register_forward_hook(lambda mod, inputs, out: out * 0.5 + 1)


def _attr_added(model, twin, module):
    model.extra = twin.extra = 3.0


def _param_stride(model, twin, module):
    for m in (model, twin):
        m.lin.weight.data = (m.lin.weight.data * 2).t().contiguous().t()     # same object, other values and strides


def _buffer_dtype(model, twin, module):
    for m in (model, twin):
        name = "acc" if hasattr(m, "acc") else "seen"
        setattr(m, name, getattr(m, name).double())


def _buffer_shape(model, twin, module):
    for m in (model, twin):
        m.calls = torch.zeros(D, device=m.calls.device)


CHANGES = {
    "class_patch": (("helper_method",), _class_patch), "instance_patch": (("helper_method",), _instance_patch),
    "closure_rebind": (("closure_scale",), _closure_rebind), "submodule": ((), _submodule), "hook": ((), _hook),
    "attr_added": (("opt_attr",), _attr_added), "param_stride": ((), _param_stride),
    "buffer_dtype": (("buf_acc", "buf_rows"), _buffer_dtype), "buffer_shape": (("buf_count",), _buffer_shape),
}


# ----------------------------------------------------------------------------------------------------- inputs
def _tensor(kind: str, B: int, gen: torch.Generator, noncontig: bool, device: str,
            data: str | None = None) -> torch.Tensor:
    """A per-call input (values from ``gen`` on the CPU, then moved; ``data``: see the module docstring);
    ``noncontig``: the same values through other strides, made on the device (a move would not keep a strided
    view)."""
    shape = (B, D) if kind != "ids" else (B,)
    if kind == "ids":
        t = _shaped_ids(torch.randint(0, 10, shape, generator=gen), data)
    elif kind == "mask":
        t = (torch.rand(shape, generator=gen) > 0.3).float()
    else:
        t = torch.randn(shape, generator=gen)
        if data in ("positive", "negative"):
            t = (t.abs() + 0.5) * (1 if data == "positive" else -1)
        if kind == "y":
            t = t.to(torch.bfloat16)
    t = t.to(device)
    if noncontig and t.dim() == 2:
        t = t.t().contiguous().t()                  # strides (1, B): column-major
    elif noncontig:
        t = torch.stack([t, t], 1)[:, 0]            # stride 2
    return t


def _shaped_ids(ids: torch.Tensor, data: str | None) -> torch.Tensor:
    if data == "mixed":
        ids[0] = 0
    elif data in ("positive", "negative"):
        ids = ids % 5 + (5 if data == "positive" else 0)
    return ids


def make_inputs(case: dict, call: dict, index: int, persistent: dict) -> dict[str, Any]:
    """The call's arguments by name (the compiled side's; the twin gets :func:`twin_inputs`)."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + index)
    device = case.get("device", "cpu")
    out: dict[str, Any] = {}
    for name in case["program"]["inputs"]:
        if name == "cache":
            out[name] = persistent["compiled"]
        elif name == "alpha":
            out[name] = call["alpha"]
        elif name == "n":
            out[name] = call["n"]
        elif name == "mask" and not case.get("mask"):
            out[name] = None
        else:
            out[name] = _tensor(name, call["B"], gen, name in call.get("noncontig", ()), device, call.get("data"))
            if name in ("x", "state", "mask") and model_dtype(case) != torch.float32:
                out[name] = out[name].to(model_dtype(case))
    return out


def twin_inputs(inputs: dict, persistent: dict) -> dict[str, Any]:
    """The twin's copy of the call's arguments: same values, dtypes and strides; its own persistent input."""
    return {name: persistent["twin"] if name == "cache" else
            (v.clone() if isinstance(v, torch.Tensor) else v) for name, v in inputs.items()}


def mark_gears(case: dict, inputs: dict) -> None:
    gears = case["options"].get("gears")
    if not gears or gears["declare"] != "marks":
        return
    for name in geared_inputs(case):
        if isinstance(inputs.get(name), torch.Tensor):
            gearcache.set_dim_gears(inputs[name], {0: gears["sizes"]}, pad_value=pad_value(case, name))


def geared_inputs(case: dict) -> list[str]:
    names = [n for n in case["program"]["inputs"] if n in ("x", "y", "ids", "state", "mask")]
    return [n for n in names if n != "mask" or case.get("mask")]


def pad_value(case: dict, name: str) -> float | None:
    """The pad value the case gives ``name`` (ids: 0, a valid index), or None: gearcache chooses it."""
    pad = case["options"]["gears"]["pad"]
    return None if pad is None else 0.0 if name == "ids" else float(pad)


# ---------------------------------------------------------------------------------------------------- options
def make_config(case: dict) -> CompilerConfig:
    o = case["options"]
    config = CompilerConfig(mode=o.get("mode", "default"))
    ic = config.inference_config
    ic.past_largest_gear = o.get("past_largest", "error")
    ic.warmup_workers = 1                           # gears compile in this process (workers: tests/test_warmup.py)
    if o.get("verify_padding"):                     # (the option's name in stored cases)
        ic.padding_check = "verify"
    if o.get("mode") == "reduce-overhead":
        ic.graph_outputs = o.get("graph_outputs", "copy")
        ic.capture_graphs = o.get("capture_graphs", "warmup")
    gears = o.get("gears")
    if gears:
        ic.dynamic_gears_merge_policy = gears["policy"]
        if gears["declare"] == "by_name":
            ic.dim_gears = {name: {0: gears["sizes"]} for name in geared_inputs(case)}
            ic.pad_values = {name: pad for name in geared_inputs(case) if (pad := pad_value(case, name)) is not None}
    return config


def compile_method(case: dict, model: torch.nn.Module, cache_dir: str):
    """The compiled ``fwd`` on the case's route: ``cache_compile``, or ``torch.compile`` with gearcache's backend."""
    o = case["options"]
    config = make_config(case)
    if o.get("route") == "torch_compile":
        import torch._dynamo

        torch._dynamo.reset()                       # each case traces afresh (no recompile limit across cases)
        backend = gearcache.get_backend(config, cache_dir=cache_dir)
        return torch.compile(model.fwd, fullgraph=True, backend=backend)
    return gearcache.cache_compile(model.fwd, config=config, dynamic=o.get("dynamic", True), cache_dir=cache_dir,
                                   custom_decompositions=decompositions(o.get("decompositions")))


# ---------------------------------------------------------------------------------------------------- compare
def tolerance(dtype: torch.dtype) -> tuple[float, float] | None:
    """``(rtol, atol)`` for a floating dtype (Inductor reorders and fuses: not bit-exact); None: must be equal."""
    if dtype in (torch.float32, torch.float64):
        return 1e-4, 1e-5
    if dtype in (torch.bfloat16, torch.float16):
        return 2e-2, 2e-2
    return None


def compare(got: Any, want: Any, where: str, out: list[str]) -> None:
    """Append to ``out`` one line per difference between ``got`` (compiled) and ``want`` (eager) under ``where``."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        _compare_tensors(got, want, where, out)
    elif type(got) is not type(want):
        out.append(f"{where}: type {type(got).__name__} != eager's {type(want).__name__} ({got!r:.60} vs {want!r:.60})")
    elif isinstance(want, (tuple, list)):
        if len(got) != len(want):
            out.append(f"{where}: length {len(got)} != eager's {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            compare(g, w, f"{where}[{i}]", out)
    elif isinstance(want, dict):
        if list(got) != list(want):
            out.append(f"{where}: keys {list(got)} != eager's {list(want)}")
        for k in want:
            if k in got:
                compare(got[k], want[k], f"{where}[{k!r}]", out)
    elif isinstance(want, float):
        if not (math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(got) and math.isnan(want))):
            out.append(f"{where}: {got!r} != eager's {want!r}")
    elif got != want:
        out.append(f"{where}: {got!r} != eager's {want!r}")


def _compare_tensors(got: Any, want: Any, where: str, out: list[str]) -> None:
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        out.append(f"{where}: {type(got).__name__} != eager's {type(want).__name__}")
        return
    if got.shape != want.shape or got.dtype != want.dtype:
        out.append(f"{where}: shape {list(got.shape)} {got.dtype} != eager's {list(want.shape)} {want.dtype}")
        return
    g, w = got.detach().cpu(), want.detach().cpu()
    tol = tolerance(w.dtype)
    if tol is not None and CASE_DTYPE["dtype"] is not None:         # a bfloat16 model's float32 outputs
        tol = max(tol, tolerance(CASE_DTYPE["dtype"]) or tol)
    if tol is None:
        bad = g != w
    else:
        rtol, atol = tol
        scale = max(1.0, w.abs().max().item()) if w.numel() and w.isfinite().all() else 1.0
        g64, w64 = g.double(), w.double()
        bad = ((g64 - w64).abs() > atol * scale + rtol * w64.abs()) & ~(g64.isnan() & w64.isnan())
        bad |= g64.isnan() != w64.isnan()
    if bad.any():
        idx = tuple(i.item() for i in bad.nonzero()[0])
        diff = (g.double() - w.double()).abs().max().item()
        out.append(f"{where}: {int(bad.sum())} of {w.numel()} values differ (max abs diff {diff:.3g}); at {list(idx)} "
                   f"got {g[idx].item():.6g}, eager {w[idx].item():.6g}")


def compare_call(out_c: Any, out_e: Any, inputs_c: dict, inputs_e: dict, model: torch.nn.Module,
                 twin: torch.nn.Module) -> list[str]:
    """Every difference after one call: outputs, inputs (updated in place or not), buffers and parameters."""
    diffs: list[str] = []
    compare(out_c, out_e, "output", diffs)
    compare_state(inputs_c, inputs_e, model, twin, diffs)
    return diffs


def compare_state(inputs_c: dict, inputs_e: dict, model: torch.nn.Module, twin: torch.nn.Module,
                  diffs: list[str]) -> None:
    for name, value in inputs_c.items():
        if isinstance(value, torch.Tensor):
            compare(value, inputs_e[name], f"input {name}", diffs)
    twin_state = dict(twin.named_buffers()) | dict(twin.named_parameters())
    for name, value in list(model.named_buffers()) + list(model.named_parameters()):
        compare(value, twin_state[name], f"module.{name}", diffs)


# ------------------------------------------------------------------------------------------------------- runs
def used_entries(fn: Any) -> list[str]:
    """The entry keys a ``cache_compile``'d method has in its table (the entries this case loaded or compiled)."""
    table = getattr(fn, "_table", None) or {}
    return sorted({e.manifest["ekey"] for e in table.values() if "ekey" in getattr(e, "manifest", {})})


def model_dtype(case: dict) -> torch.dtype:
    """The dtype of the case's model and float inputs (``options["dtype"]``, drawn on the GPU; else float32)."""
    return getattr(torch, case["options"].get("dtype", "float32"))


def _persistent(case: dict) -> dict:
    if "cache" not in case["program"]["inputs"]:
        return {}
    device = case.get("device", "cpu")
    base = torch.zeros(ROWS, D, device=device, dtype=model_dtype(case))
    return {"compiled": base, "twin": base.clone()}


def _warmup(case: dict, fn: Any, persistent: dict, model, twin) -> list[str]:
    """``warmup()`` on inputs of the largest gear; returns the differences it left in the module and persistent
    input (it compiles or loads entries: it must not change state)."""
    sizes = case["options"]["gears"]["sizes"] if case["options"].get("gears") else [case["calls"][0]["B"]]
    example = dict(case["calls"][0], B=max(sizes), noncontig=[])
    inputs = make_inputs(case, example, 999, persistent)
    mark_gears(case, inputs)
    fn.warmup(*inputs.values())
    diffs: list[str] = []
    persistent_c = {"cache": persistent["compiled"]} if persistent else {}
    persistent_e = {"cache": persistent["twin"]} if persistent else {}
    compare_state(persistent_c, persistent_e, model, twin, diffs)
    return [f"after warmup(): {d}" for d in diffs]


def run_case(case: dict, src_dir: str | Path, cache_dir: str) -> dict:
    """Run ``case`` (see the module docstring) with the program files in ``src_dir`` against the store ``cache_dir``.
    Returns ``{"outcome", "detail", "call", "entries", "counters", "seconds"}``."""
    t0 = time.perf_counter()
    before = counters.snapshot()
    program = case["program"]
    module = load_program(src_dir, program)
    result: dict[str, Any] = {"outcome": "equal", "detail": "", "call": None, "entries": []}
    fn = None
    try:
        with assigned(program, case.get("assign", {})), torch.no_grad():
            torch.manual_seed(case["seed"])
            CASE_DTYPE["dtype"] = model_dtype(case)
            model = module.Prog(**case.get("attrs", {})).to(case.get("device", "cpu"), model_dtype(case))
            twin = copy.deepcopy(model)
            fn = compile_method(case, model, cache_dir)
            result.update(_run_calls(case, fn, model, twin))
    finally:
        CASE_DTYPE["dtype"] = None
        if fn is not None:
            result["entries"] = used_entries(fn)
        result["counters"] = {k: v for k, v in counters.delta(before).items() if k in COUNTED}
        result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _run_calls(case: dict, fn: Any, model, twin) -> dict:
    persistent = _persistent(case)
    if case.get("device") == "cuda" and persistent and case["options"].get("static_address"):
        gearcache.mark_static_address(persistent["compiled"])
    step = "warmup()"
    change = case.get("change")
    undo: list = []
    try:
        if case["options"].get("warmup"):
            diffs = _warmup(case, fn, persistent, model, twin)
            if diffs:
                return {"outcome": "mismatch", "detail": "\n".join(diffs[:6]), "call": -1}
        for i, call in enumerate(case["calls"]):
            step = f"call {i}"
            if change and i == (0 if change["when"] == "before" else 1):
                undo.append(CHANGES[change["kind"]][1](model, twin, sys.modules[case["program"]["module"]]))
            result = _one_call(case, i, call, fn, model, twin, persistent)
            if result:
                return result
    except gearcache.GearcacheError as exc:
        return {"outcome": "refused", "detail": f"{step}: {type(exc).__name__}: {exc}"[:600], "call": step}
    except Exception as exc:                # noqa: BLE001 - anything but a gearcache error is a failure
        tb = traceback.format_exc(limit=-4)
        return {"outcome": "crash", "detail": f"{step}: {type(exc).__name__}: {exc}"[:600] + "\n" + tb[-1500:],
                "call": step}
    finally:
        for u in undo:
            if u is not None:
                u()
    return {}


def _one_call(case: dict, i: int, call: dict, fn: Any, model, twin, persistent: dict) -> dict:
    """Call ``i`` on both sides; ``{}`` when they agree, else the case's result. A mismatch is checked against plain
    ``torch.compile`` (Inductor without gearcache) on the state and inputs from before the call: if that computes
    the very same answer, the outcome is ``upstream`` (a bug of torch's compiler, served as it is)."""
    inputs_c = make_inputs(case, call, i, persistent)
    inputs_e = twin_inputs(inputs_c, persistent)
    before = (copy.deepcopy(twin), twin_inputs(inputs_e, {"twin": _clone(persistent.get("twin"))}))
    mark_gears(case, inputs_c)
    try:
        out_e = twin.fwd(*inputs_e.values())
    except Exception as exc:                # noqa: BLE001 - a program torch cannot run is the generator's bug
        return {"outcome": "invalid", "detail": f"eager twin raised {type(exc).__name__}: {exc}", "call": i}
    out_c = fn(*inputs_c.values())
    diffs = compare_call(out_c, out_e, inputs_c, inputs_e, model, twin)
    if not diffs:
        return {}
    result = {"outcome": "mismatch", "detail": "\n".join(diffs[:6]), "call": i}
    if not case.get("oracle", True):
        return result
    if ORACLE_CHECKS["left"] <= 0:
        result["detail"] += "\n(not checked against plain torch.compile: this process's checks are spent)"
        return result
    ORACLE_CHECKS["left"] -= 1
    if _same_as_inductor(out_c, inputs_c, model, *before):
        result.update(outcome="upstream", detail=result["detail"] + "\nplain torch.compile (Inductor, no gearcache) "
                      "computes the same answer: a bug of torch's compiler")
    return result


def _clone(t: Any) -> Any:
    return t.clone() if isinstance(t, torch.Tensor) else t


def _same_as_inductor(out_c: Any, inputs_c: dict, model, ref_model, ref_inputs: dict) -> bool:
    """Whether ``torch.compile(fullgraph=True, dynamic=False)`` of a copy of the module taken before the call, on a
    copy of the call's inputs, gives what gearcache gave (outputs, inputs and module state)."""
    import torch._dynamo

    try:
        torch._dynamo.reset()
        out_o = torch.compile(ref_model.fwd, fullgraph=True, dynamic=False)(*ref_inputs.values())
    except Exception:                       # noqa: BLE001 - no verdict: the mismatch stands
        return False
    finally:
        torch._dynamo.reset()
    return not compare_call(out_c, out_o, inputs_c, ref_inputs, model, ref_model)
