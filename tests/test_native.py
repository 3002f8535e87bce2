"""gearcache.native: the native checks answer as Dynamo's do (and see more of the state), are loaded only when built
for this torch and safe to load, and are built in the background by the first process that lacks them."""
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch
from torch_settings import attribute, setting

from gearcache._torch import state as torch_state, tensor_checks as torch_tensor_checks
from gearcache import native
from gearcache.errors import NativeBuildError
from gearcache.native import build as native_build
from gearcache.call.signature import call_key, matcher

dynamo_guards = torch._C._dynamo.guards


@pytest.fixture(scope="module")
def module(native_checks):
    loaded = native.guards(build_if_missing=False)
    assert loaded is not None and os.path.samefile(loaded.__file__, native_checks)
    return loaded


def dynamo_match(tensors):
    return dynamo_guards.TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                      dynamic_dims_strides=[list(t.stride()) for t in tensors]).check


# ----------------------------------------------------------------------------------------------- TensorMatch
def _candidates(a, b, c):
    """(name, arguments, expected answer) against reference tensors (a, b, c)."""
    with torch.inference_mode():
        made_in_inference = torch.randn(4, 8)
    return [
        ("the same tensors", (a, b, c), True),
        ("new tensors, same metadata", (torch.randn(4, 8), torch.randn(3, 2).t(), torch.zeros(1, dtype=torch.long)),
         True),
        ("another size", (torch.randn(5, 8), b, c), False),
        ("another rank", (torch.randn(4, 8, 1), b, c), False),
        ("another stride (contiguous copy of a transpose)", (a, b.contiguous(), c), False),
        ("another dtype", (a, b, c.float()), False),
        ("requires_grad", (a.detach().requires_grad_(), b, c), False),
        ("another Python type (Parameter)", (torch.nn.Parameter(a.clone()), b, c), False),
        ("an inference tensor (other dispatch keys)", (made_in_inference, b, c), False),
        ("one tensor twice", (a, a, c), False),
    ]


def test_tensor_match_answers_as_dynamos_check(module):
    a, b, c = torch.randn(4, 8), torch.randn(3, 2).t(), torch.zeros(1, dtype=torch.long)
    ours, theirs = module.TensorMatch((a, b, c)), dynamo_match((a, b, c))
    for name, args, expected in _candidates(a, b, c):
        assert ours(*args) is expected, name
        assert theirs(*args) is expected, name
    with torch.inference_mode():                    # the thread's dispatch state changes the effective keys
        assert ours(a, b, c) is theirs(a, b, c) is False


def test_tensor_match_checks_its_arguments(module):
    a = torch.randn(2)
    match = module.TensorMatch((a,))
    with pytest.raises(TypeError, match="made for 1 tensors called with 2"):
        match(a, a)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a int, not a tensor"):
        module.TensorMatch((a, 3))
    with pytest.raises(TypeError, match="not a plain strided tensor"):
        module.TensorMatch((torch.eye(3).to_sparse(),))
    with pytest.raises(TypeError, match="not initialised"):
        module.TensorMatch.__new__(module.TensorMatch)(a)


def test_tensor_match_compares_storages_where_asked(module):
    """``distinct``: no two arguments on one storage; ``forbidden``: none whose storage overlaps a byte range named
    for its place (as memory.storage_range gives it; an empty range names nothing); the metadata is checked as
    without them."""
    import numpy

    from gearcache.call.memory import storage_range

    base, other = torch.zeros(8), torch.zeros(8)
    distinct = module.TensorMatch((torch.ones(2), torch.ones(2)), distinct=True)
    assert distinct(torch.ones(2), torch.ones(2)) and not distinct(base[:2], base[4:6])
    assert not distinct(torch.ones(3), torch.ones(2))
    forbidden = module.TensorMatch((torch.ones(2), torch.ones(2)), forbidden=(None, (storage_range(base), (7, 7))))
    assert not forbidden(torch.ones(2), base[6:]) and forbidden(base[6:], torch.ones(2))
    assert forbidden(base[:2], base[2:4].clone()) and forbidden(torch.ones(2), other[:2])
    array = numpy.arange(8, dtype=numpy.float32)
    over = module.TensorMatch((torch.ones(2),), forbidden=((storage_range(torch.from_numpy(array[2:4])),),))
    assert not over(torch.from_numpy(array[3:5])) and not over(torch.from_numpy(array[1:3]))
    assert over(torch.from_numpy(array[:2])) and over(torch.from_numpy(array[4:6]))
    with pytest.raises(TypeError, match="an item per tensor"):
        module.TensorMatch((torch.ones(2),), forbidden=(None, None))
    with pytest.raises(TypeError):
        module.TensorMatch((torch.ones(2),), forbidden=(("x",),))
    with pytest.raises(TypeError, match="pair"):
        module.TensorMatch((torch.ones(2),), forbidden=((5,),))


def test_a_sparse_tensor_gets_dynamos_check(module):
    sparse = torch.eye(3).to_sparse()
    check = torch_tensor_checks.tensor_match((sparse,))
    assert not isinstance(check, module.TensorMatch)
    assert check(torch.eye(3).to_sparse()) and not check(torch.eye(4).to_sparse())


# --------------------------------------------------------------------------------------------- StateSnapshot
matmul = torch.backends.cuda.matmul
STATES = {
    "grad on": lambda: torch.enable_grad(),
    "inference mode": lambda: torch.inference_mode(),
    "autocast cpu": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast cpu float16": lambda: torch.autocast("cpu", dtype=torch.float16),
    "autocast cache off": lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
    "default dtype": lambda: setting(torch.get_default_dtype, torch.set_default_dtype, torch.float64),
    "deterministic": lambda: setting(torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms,
                                      True),
    "deterministic warn only": lambda: setting(
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]), (True, True)),
    "torch function for subclasses disabled": lambda: torch._C.DisableTorchFunctionSubclass(),
    "all torch function disabled": lambda: torch._C.DisableTorchFunction(),
    "cuBLAS TF32": lambda: attribute(matmul, "allow_tf32", not matmul.allow_tf32),
    "fp16 reduced precision": lambda: attribute(matmul, "allow_fp16_reduced_precision_reduction",
                                            not matmul.allow_fp16_reduced_precision_reduction),
    "bf16 reduced precision": lambda: attribute(matmul, "allow_bf16_reduced_precision_reduction",
                                            not matmul.allow_bf16_reduced_precision_reduction),
    "float32 matmul precision": lambda: setting(torch.get_float32_matmul_precision,
                                                 torch.set_float32_matmul_precision, "medium"),
    **{f"SDPA {name}": (lambda name=name: setting(getattr(torch.backends.cuda, f"{name}_sdp_enabled"),
                                                   getattr(torch.backends.cuda, f"enable_{name}_sdp"),
                                                   not getattr(torch.backends.cuda, f"{name}_sdp_enabled")()))
       for name in ("flash", "mem_efficient", "math", "cudnn")},
    "thread count": lambda: setting(torch.get_num_threads, torch.set_num_threads, torch.get_num_threads() + 1),
}


def cudnn_tf32():
    return attribute(torch.backends.cudnn, "allow_tf32", not torch.backends.cudnn.allow_tf32)


@pytest.mark.parametrize("name", STATES)
def test_the_snapshot_sees_every_setting(module, name):
    with torch.no_grad():
        same = module.StateSnapshot()
        assert same()
        with STATES[name]():
            assert not same()
        assert same()


def test_the_snapshot_covers_the_key_state_but_cudnn_tf32(module):
    """Whatever changes ``torch_state.global_state()`` (the key's state) makes the snapshot say False, but cuDNN's TF32
    flag (left out, as Dynamo leaves it out: a hash lookup per call on torch 2.13; the next miss keys it)."""
    plain = torch_state.global_state(["cpu"])
    same = module.StateSnapshot()
    changed = 0
    for name, set_state in STATES.items():
        with set_state():
            if torch_state.global_state(["cpu"]) != plain:
                changed += 1
                assert not same(), name
    assert changed >= 15
    with cudnn_tf32():
        assert torch_state.global_state(["cpu"]) != plain and same()


def test_the_native_snapshot_also_stands_for_the_matchers_inference_mode_check(module):
    x = torch.randn(2, 4)
    with torch.no_grad():
        matches = matcher(*call_key((x,), {}))
        assert isinstance(matches.same_state, module.StateSnapshot) and isinstance(matches.check, module.TensorMatch)
        assert matches.is_inference_mode_enabled is None and matches((x,))
    with torch.inference_mode():
        assert not matches((x,))


def test_gearcache_native_0_turns_it_off(module, monkeypatch):
    monkeypatch.setenv("GEARCACHE_NATIVE", "0")
    assert native.guards() is None and torch_tensor_checks.native_data_ptr() is None
    same = torch_state.state_guard()
    assert not isinstance(same, module.StateSnapshot) and not torch_state.state_guard_covers_inference_mode(same)
    x = torch.randn(2, 4)
    with torch.no_grad():
        matches = matcher(*call_key((x,), {}))
    assert matches.is_inference_mode_enabled is torch.is_inference_mode_enabled
    assert not isinstance(matches.check, module.TensorMatch)


# ----------------------------------------------------------------------------------------- loading and building
def test_a_module_built_for_another_key_is_not_loaded(module, caplog):
    with caplog.at_level("WARNING", logger="gearcache.native"):
        assert native._load(module.__file__, "another-key") is None
    assert "built for key" in caplog.text and module.BUILD_KEY in caplog.text


def test_a_module_others_can_write_is_not_loaded(module, tmp_path, caplog):
    folder = tmp_path / "k"
    folder.mkdir(mode=0o700)
    path = folder / native.MODULE_FILE
    shutil.copy(module.__file__, path)
    os.chmod(path, 0o775)
    with caplog.at_level("WARNING", logger="gearcache.native"):
        assert native._load(str(path), module.BUILD_KEY) is None
    assert "writable by group or others" in caplog.text


def test_a_failed_build_says_why_and_is_not_retried_automatically(tmp_path, monkeypatch):
    monkeypatch.setenv("GEARCACHE_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")                  # a "compiler" that fails at once
    with pytest.raises(NativeBuildError, match="exit status 1") as failure:
        native_build.build()
    folder = tmp_path / native.extension_key()
    assert str(folder / native.LOG_FILE) in str(failure.value)
    assert (folder / native.FAILED_FILE).exists() and not (folder / native.MODULE_FILE).exists()
    assert list(folder.glob(".build-*")) == []          # the temporary output is removed
    assert native_build.build(retry_failed=False) is None
    assert native_build.main(["--if-idle"]) == 0        # what the background build runs: skips it quietly


@pytest.mark.slow
def test_a_process_without_the_module_builds_it_in_the_background(tmp_path):
    """The first process finds none, starts the build and goes on with Dynamo's checks; a later process loads it."""
    env = {**os.environ, "GEARCACHE_NATIVE_DIR": str(tmp_path)}
    probe = ("import sys, torch; from gearcache import native; from gearcache._torch import tensor_checks as "
             "torch_tensor_checks; "
             "m = native.guards(); x = torch.randn(2); check = torch_tensor_checks.tensor_match((x,)); "
             "print(m is not None, type(check).__name__, check(x))")
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["False", "builtin_function_or_method", "True"]     # Dynamo's check
    target = tmp_path / native.extension_key() / native.MODULE_FILE
    deadline = time.monotonic() + 600
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert target.exists(), (tmp_path / native.extension_key() / native.LOG_FILE).read_text()
    assert stat.S_IMODE(target.stat().st_mode) & 0o022 == 0
    later = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert later.returncode == 0, later.stderr
    assert later.stdout.split() == ["True", "TensorMatch", "True"]


@pytest.mark.slow
def test_processes_building_at_once_compile_once(tmp_path):
    """Two builds of the same key at once: one compiles, the other waits on the lock and finds the module."""
    counter = tmp_path / "compiles"
    cxx = tmp_path / "counting-c++"
    cxx.write_text(f'#!/bin/sh\necho x >> "{counter}"\nexec "{native_build.compiler()}" "$@"\n')
    cxx.chmod(0o755)
    env = {**os.environ, "GEARCACHE_NATIVE_DIR": str(tmp_path / "native"), "CXX": str(cxx)}
    procs = [subprocess.Popen([sys.executable, "-m", "gearcache.native.build"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1 and os.path.exists(paths.pop())
    assert counter.read_text().count("x") == 1
    assert list((tmp_path / "native").glob("*/.build-*")) == []
