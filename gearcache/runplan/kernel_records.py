"""The launch record of each Triton kernel of a compiled graph (compile time; imports torch's compiler).

Inductor launches most kernels through torch's static CUDA launcher, and the rest through Triton's own generated
launcher. Its reasons to do so fall in two groups, and gearcache covers both:

- **Inductor could not find the cubin** (``Cubin path not found``): Triton truncates a kernel's file names to 150
  characters, and Inductor looks for the untruncated name. Kernels fusing many ops (any transformers attention
  block: ``triton_poi_fused__scaled_dot_product_efficient_attention_..._3``) have such names. The kernel itself is
  an ordinary one: its record says ``"launcher": "static"`` and it takes the static path at load.
- **The kernel needs what the static launcher does not do**: thread-block clusters (``num_ctas > 1``), global or
  profile scratch memory, PDL or cooperative launches, 16-bit float scalars: ``"launcher": "driver"``
  (launch_driver.py).

Kernels taking TMA tensor descriptors (``nvTmaDesc`` / ``tensordesc`` arguments: descriptors are built on the host
for each call) and kernels with launch hooks get no record: the artifact gets no plan and says so.
"""
from __future__ import annotations

import pathlib
from typing import Any

from .._torch import runplan as torch_runplan
from ..errors import NoPlan
from .format import require

TRITON_NAME_LIMIT = 150     # triton/compiler/compiler.py: ``file_name = src.name[:150]``

# Triton signature types -> the launch record's one-character codes (launch_driver._PACK; torch's static launcher
# knows all but e/E).
_TYPE_CODES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
               "u32": "I", "u64": "K", "fp16": "e", "bf16": "E", "fp32": "f", "f32": "f", "fp64": "d"}


def triton_records(autotuners: dict[str, Any], bundle: Any, plan_dir: pathlib.Path) -> dict[str, Any]:
    """``{kernel name: launch record}`` for the wrapper's autotuned kernels, cubins written to ``kernels/``.

    ``autotuners``: the wrapper module's ``CachingAutotuner`` objects after a run (autotuning settled); ``bundle``:
    the FX graph entry's Triton bundle (the cubins of every config that was compiled)."""
    if not autotuners:
        return {}
    cubins: dict[tuple[str, str], bytes] = {}
    if bundle is not None:
        cubins = {(group.kernel_hash, item.filename): item.payload
                  for group in bundle.kernel_artifacts for item in group.artifacts}
    records = {}
    for name, autotuner in autotuners.items():
        require(len(autotuner.launchers) == 1, f"{name}: {len(autotuner.launchers)} launchers after autotuning")
        launcher = autotuner.launchers[0]
        result = next((r for r in autotuner.compile_results if r.config is launcher.config), None)
        if result is None:
            raise NoPlan(f"{name}: the autotuner's chosen config has no compile result")
        require(not getattr(launcher, "store_cubin", 0) or type(result).__name__ == "StaticTritonCompileResult",
                f"{name}: launched with store_cubin")
        if type(result.kernel).__name__ == "StaticallyLaunchedCudaKernel":
            record, cubin = _static_record(name, result, launcher, cubins)
        else:
            record, cubin = _triton_launcher_record(name, result, launcher, cubins)
        (plan_dir / "kernels").mkdir(exist_ok=True)
        (plan_dir / "kernels" / f"{launcher.cache_hash}.cubin").write_bytes(cubin)
        record["cubin"] = f"runplan/kernels/{launcher.cache_hash}.cubin"
        records[name] = {**record, **_grid(result)}
    return records


def _grid(result: Any) -> dict[str, Any]:
    prefix, grid = torch_runplan.kernel_grid(result.inductor_meta, result.config)
    return {"grid_prefix": prefix, "grid": grid}


def _cubin_from_bundle(cubins: dict[tuple[str, str], bytes], cache_hash: str, kernel_name: str) -> bytes | None:
    for file_name in (kernel_name, kernel_name[:TRITON_NAME_LIMIT]):
        payload = cubins.get((cache_hash, f"{file_name}.cubin"))
        if payload is not None:
            return payload
    return None


def _static_record(name: str, result: Any, launcher: Any,
                   cubins: dict[tuple[str, str], bytes]) -> tuple[dict[str, Any], bytes]:
    """A kernel Inductor launched through torch's static launcher: its record is what that launcher was given."""
    binary = result.kernel
    cubin = _cubin_from_bundle(cubins, launcher.cache_hash, binary.name)
    if cubin is None:
        raise NoPlan(f"{name}: its cubin is not in the artifact")
    _, def_args, none_args = torch_runplan.kernel_arg_lists(result, binary.arg_names, binary.declared_constexprs)
    scratch = int(bool(binary.has_global_scratch)) + int(bool(binary.has_profile_scratch))
    extra = {"num_ctas": 1, "cluster_dims": [1, 1, 1], "launch_pdl": False, "launch_cooperative_grid": False,
             "global_scratch_size": 0, "global_scratch_align": 1, "profile_scratch_size": 0,
             "profile_scratch_align": 1}
    launcher_name = choose_launcher(extra, binary.arg_tys)
    return {
        **(extra if launcher_name == "driver" else {}),
        "launcher": launcher_name, "function": binary.name, "shared": int(binary.shared),
        "num_warps": int(binary.num_warps), "arg_types": binary.arg_tys + "O" * scratch, "scratch_args": scratch,
        "def_args": list(def_args),
        "call_args": [a for i, a in enumerate(binary.arg_names)
                      if i not in binary.full_constexprs and a not in none_args],
    }, cubin


def _triton_launcher_record(name: str, result: Any, launcher: Any,
                            cubins: dict[tuple[str, str], bytes]) -> tuple[dict[str, Any], bytes]:
    """A kernel Inductor left to Triton's own launcher: the record is built from Triton's ``CompiledKernel``."""
    kernel = result.kernel
    require(hasattr(kernel, "metadata") and hasattr(kernel, "src"), f"{name}: {type(kernel).__name__}")
    md, src = kernel.metadata, kernel.src
    fn_name = src.fn.__name__
    cubin = _kernel_cubin(kernel) or _cubin_from_bundle(cubins, launcher.cache_hash, fn_name)
    if cubin is None:
        raise NoPlan(f"{name}: its cubin is not in the artifact")
    arg_names = list(src.fn.arg_names)
    arg_types, constexprs = _arg_types(name, src, arg_names)
    _, def_args, none_args = torch_runplan.kernel_arg_lists(result, arg_names, torch_runplan.triton_constexprs(src.fn))
    has_global = hasattr(md, "global_scratch_size")
    has_profile = hasattr(md, "profile_scratch_size")
    extra = {
        "num_ctas": int(getattr(md, "num_ctas", 1) or 1),
        "cluster_dims": [int(c) for c in (getattr(md, "cluster_dims", None) or (1, 1, 1))],
        "launch_pdl": bool(getattr(md, "launch_pdl", False)),
        "launch_cooperative_grid": bool(getattr(md, "launch_cooperative_grid", False)),
        "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
        "global_scratch_align": int(getattr(md, "global_scratch_align", 1) or 1),
        "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0),
        "profile_scratch_align": int(getattr(md, "profile_scratch_align", 1) or 1),
    }
    record = {
        "launcher": choose_launcher(extra, arg_types),
        "function": str(getattr(md, "name", fn_name)), "shared": int(md.shared), "num_warps": int(md.num_warps),
        "arg_types": arg_types + "O" * (int(has_global) + int(has_profile)),
        "scratch_args": int(has_global) + int(has_profile), "def_args": list(def_args),
        "call_args": [a for i, a in enumerate(arg_names) if i not in constexprs and a not in none_args],
    }
    if record["launcher"] == "driver":
        record.update(extra)
    return record, cubin


def choose_launcher(extra: dict[str, Any], arg_types: str) -> str:
    """``"static"`` where torch's static launcher launches the kernel exactly as Triton's would, else ``"driver"``."""
    static_ok = (extra["num_ctas"] == 1 and extra["cluster_dims"] == [1, 1, 1] and not extra["launch_pdl"]
                 and not extra["launch_cooperative_grid"] and extra["global_scratch_size"] == 0
                 and extra["profile_scratch_size"] == 0 and not set(arg_types) & {"e", "E"})
    return "static" if static_ok else "driver"


def _kernel_cubin(kernel: Any) -> bytes | None:
    try:
        cubin = kernel.asm["cubin"]
    except (KeyError, AttributeError, TypeError, OSError):
        return None
    return cubin if isinstance(cubin, bytes) else None


def _arg_types(name: str, src: Any, arg_names: list[str]) -> tuple[str, set[int]]:
    """The codes of the arguments the cubin takes (constexprs are compiled in and not passed), and the indices of
    the constexprs. Triton 3.3+ keys ``src.signature`` by name and ``src.constants`` by index tuples."""
    def index(key: Any) -> int:
        if isinstance(key, str):
            return arg_names.index(key)
        return key[0] if isinstance(key, tuple) else int(key)

    signature = {index(k): v for k, v in src.signature.items()}
    constexprs = {index(k) for k in getattr(src, "constants", {})}
    codes = []
    for i in sorted(signature):
        ty = signature[i]
        if ty == "constexpr" or i in constexprs:
            constexprs.add(i)
            continue
        if ty.startswith("*"):
            codes.append("O")
        elif ty in _TYPE_CODES:
            codes.append(_TYPE_CODES[ty])
        elif "tensordesc" in ty or ty == "nvTmaDesc":
            raise NoPlan(f"{name}: TMA tensor-descriptor arguments (built on the host for each call)")
        else:
            raise NoPlan(f"{name}: argument type {ty!r}")
    return "".join(codes), constexprs
