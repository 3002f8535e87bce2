"""The one place gearcache touches torch's private APIs or branches on torch's version: a package of modules by
consumer. Every private symbol gearcache uses is named here and nowhere else (tests/test_structure.py checks it), and
each function says which mechanism it relies on, so a torch upgrade is reviewed in this folder.

Supported: torch 2.11 to 2.15 (README, "Supported torch versions"): 2.11 on the GPU machine (CUDA), 2.13 in CI (CPU,
full suite), 2.14.1 in CI (CUDA build on CPU, core suites), 2.15.0 checked by hand (CPU); 2.14 and 2.15 need no
branch here.

Modules, by who uses them (users import the module, ``from .._torch import state as torch_state``, and call
``torch_state.global_state()``; this package re-exports nothing):

- :mod:`.capture`: Dynamo settings, dynamic-dim marks, traced code, graph breaks (gearcache/compiling/capture.py,
  gearcache/gears/plan.py).
- :mod:`.guards`: Dynamo's guards of a capture in plain terms (compiling/capture.py, keys/guards.py).
- :mod:`.shapes`: symbolic sizes of a trace and the guards on them (compiling/, gears/padding.py).
- :mod:`.aten`: a graph retraced to ATen ops with their schemas (gears/padding.py, compiling/torch_compile_backend.py).
- :mod:`.inductor`: compiling to an artifact folder and loading it, Inductor's mode settings (compiling/, runplan/
  loader.py, config.py).
- :mod:`.worker_compile`: the graph and settings as they cross to a compile worker process (compiling/workers.py).
- :mod:`.runplan`: what gearcache's own loader and writer of run plans need (runplan/).
- :mod:`.tensor_checks`: the dispatch shortcut's per-call tensor checks (call/, keys/guard_watch.py).
- :mod:`.state`: the thread's global torch state as a key factor, its guard, applying it elsewhere, autocast switches
  (call/, compiling/, warmup/, runplan/runner.py).
- :mod:`.nn_modules`: parameter and buffer slots, ``nn.Module`` attributes as torch defines them (call/entry.py,
  keys/fingerprints.py).
- :mod:`.cuda_graphs`: the graph pool handle's type and unreadable output storage (graphs/cuda_graphs.py).
- :mod:`.distributed`: process groups by c10d name, the default store, intercepting collectives (ranks/, runplan/,
  graphs/, keys/guards.py).
- :mod:`.versions`: torch's version, the software and device key factors (call/, compiling/, cli/checks.py).

Warm processes run gearcache's own loader (gearcache/runplan/), not torch's: :mod:`.runplan`'s run-time half touches
``torch._C`` only. The dispatch shortcut's checks come from gearcache's native module where it is built for this
torch (compiled against torch's own headers, so its private C++ API is checked by the compiler; gearcache/native/),
else from Dynamo. This package imports nothing else from gearcache; ``gearcache.native`` imports only
``gearcache.errors``. The modules import nothing from one another.
"""
