"""Run plans: gearcache's own loader for Inductor's generated code, and the writer that prepares it.

torch's loader (``CompiledArtifact.load``) imports Inductor and AOTAutograd with all their registrations before it
reads a byte (3.7 s on the H200 host, 1.5 s here). A call needs far less: Inductor's generated Python wrapper, the
kernel binaries, the launch parameters the autotuner settled on and a handful of runtime helpers. At compile time
:func:`write_run_plan` records these in the artifact's ``runplan/`` folder, after checking on the compiling call's
own inputs that the plan's outputs are identical to those of torch's loader; :func:`load_artifact` runs such a plan
in a warm process importing nothing from ``torch._inductor`` or ``triton``.

One load, in one direction: the store reads the plan once (:func:`read_plan`) to choose what to verify
(:func:`files_read`: ``runplan/`` and the C++ libraries it names, a few files of the hundreds torch's artifact holds)
and verifies it (``gearcache/compiling/artifact_io.py``), then hands the same plan to :func:`load_artifact`, the one
loader
entry point, which builds a :class:`PlanRunner` from it, or falls back to torch's loader itself (calling its
``before_torch_loader``, where the store verifies the rest of the artifact first). The torch.compile route calls
:func:`load_artifact` on the folder it just published, which reads the plan itself. Each load reads ``plan.json``
once.

Modules:
    loader.py          the entry point: reads the plan, chooses it or torch's loader, executes the wrapper with
                       the plan's kernels (:func:`load_artifact`, :func:`read_plan`, :func:`files_read`)
    runner.py          :class:`PlanRunner`, the per-call work around the wrapper's ``call()`` (alignment, grad,
                       autocast, version counters)
    writer.py          what a plan records, and the exactness check (compile time; imports torch's compiler)
    kernel_records.py  the launch record of each Triton kernel, whichever launcher Inductor used for it
    collectives.py     functional collectives: their stand-ins during the check, the groups a plan is bound to
    device_binding.py  rewrites the wrapper's GPU index literals into a name the loader binds to the live GPU
    stand_ins.py       the wrapper's ``torch._inductor`` and ``triton`` imports, served without importing them
    launch_static.py   Triton kernels through torch's static CUDA launcher (``torch._C._StaticCudaLauncher``)
    launch_driver.py   Triton kernels the static launcher cannot take (clusters, scratch memory, PDL, cooperative
                       grids), through the CUDA driver's ``cuLaunchKernelEx``
    launch_cpp.py      C++ kernels imported from the ``.so`` files the artifact carries
    format.py          constants the writer and the loader share

Its exceptions (``RunPlanUnavailable``, ``NoPlan``, ``WrongDevice``) live in gearcache/errors.py, the private torch
symbols it uses in gearcache/_torch/runplan.py.

On-disk format (``runplan/`` of an artifact folder; covered by the artifact's digests and signature)::

    plan.json   {"format": 1, "supported": bool, "reason": str (why not, when not supported),
                 "device_index": int | null,    the GPU it was compiled on (null: CPU only; in every plan)
                 "device_free": bool,           runs on any GPU of the kind (in every plan): a CPU graph, or a
                                                wrapper whose index literals all became ``gearcache_device_index``;
                                                false: only the compile GPU runs it (unsupported plans on a GPU)
                 "device_reason": str,          why a supported CUDA plan stays bound (when it does)
                 "device_type": "cuda" | "cpu", "wrapper": "wrapper.py",
                 "wrapper_code": "wrapper.code",
                 "num_inputs": int, "num_outputs": int,
                 "inputs_to_check": [int],      inputs assumed 16-byte aligned (cloned when they are not)
                 "mutated_inputs": [int],       inputs the graph writes in place (written back after a clone)
                 "version_bumped_inputs": [int],  inputs whose autograd version counter a call bumps
                 "extern_kernels": {name: ["torch", attr] | ["op", "ns::op", overload]},
                 "ops": [[ns, op], ...],        operators the wrapper looks up in torch.ops
                 "groups": {name: {"ranks": [int], "backend": str}},  process groups its collectives name
                 "triton": {kernel: {"launcher": "static" | "driver",
                            "cubin": "runplan/kernels/<hash>.cubin", "function": str, "shared": int,
                            "num_warps": int, "arg_types": str, "scratch_args": int, "def_args": [str],
                            "call_args": [str], "grid_prefix": [str], "grid": [x, y, z],
                            driver only: "num_ctas": int, "cluster_dims": [x, y, z], "launch_pdl": bool,
                            "launch_cooperative_grid": bool, "global_scratch_size": int,
                            "global_scratch_align": int, "profile_scratch_size": int,
                            "profile_scratch_align": int}},
                 "cpp": {sha256 of a C++ kernel's source: path of its .so inside the artifact}}
    wrapper.py  Inductor's generated wrapper module, run unchanged but for its device index literals, which a
                device-free plan reads from the global ``gearcache_device_index`` (bound by the loader to the
                caller's GPU; kernels are loaded on that GPU)
    wrapper.code  the same, compiled: the interpreter's magic number + marshalled code (skips a ~20 ms compile)
    kernels/    Triton cubins

A record without ``"launcher"`` (written before the driver path existed) is a static one. ``arg_types`` holds one
character per argument passed to the cubin, in torch's static launcher's code (``O`` pointer or None, ``i``/``l``
32/64-bit signed, ``I``/``K`` unsigned, ``b``/``h``/``B``/``H`` 8/16-bit, ``f`` float, ``d`` double); the driver
path adds ``e`` (fp16) and ``E`` (bf16), passed as their 16-bit patterns.
"""
from ..errors import RunPlanUnavailable, WrongDevice
from .format import ALIGNMENT, FORMAT, PLAN_DIR
from .loader import files_read, load_artifact, read_plan
from .runner import PlanRunner
from .writer import device_bound_reason, write_run_plan

__all__ = ["ALIGNMENT", "FORMAT", "PLAN_DIR", "PlanRunner", "RunPlanUnavailable", "WrongDevice", "device_bound_reason",
           "files_read", "load_artifact", "read_plan", "write_run_plan"]
