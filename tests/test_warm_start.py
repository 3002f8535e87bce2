"""A fresh process with the cache present runs with no tracing, no guards and no compiler (issue: core).

Runs on CPU by default; ``GEARCACHE_TEST_DEVICE=cuda python -m pytest tests/test_warm_start.py`` runs the same checks
with the model and inputs on the GPU (Triton kernels, cubins), as done on the device machine.
"""


def test_cold_process_compiles_each_entry_point_once_and_matches_eager(tiny_lm_cache):
    _, cold = tiny_lm_cache
    assert cold["precompiled_headers"] is False, "the product's default compile (the other tests build with a PCH)"
    assert cold["equal"]
    assert cold["counters"]["compiles"] == 2          # prefill and decode are separate entries
    assert cold["counters"]["traces"] == 2
    assert cold["counters"]["loads"] == 0


def test_warm_process_traces_and_compiles_nothing(tiny_lm_warm):
    warm = tiny_lm_warm["hooks"]
    assert warm["equal"]
    assert warm["hooks"] == {"dynamo_frames": 0, "guard_builds": 0,
                             "inductor_compiles": 0, "inductor_codegen": 0, "cpp_builds": 0, "triton_compiles": 0}
    assert warm["counters"]["loads"] == 2
    assert warm["counters"]["compiles"] == 0 and warm["counters"]["traces"] == 0


def test_warm_process_does_not_import_torchs_compiler(tiny_lm_warm):
    """Entries load through their run plans (gearcache.runplan): Dynamo and Inductor are never imported."""
    warm = tiny_lm_warm["plain"]
    assert warm["equal"] and warm["precompiled_headers"] is False
    assert warm["counters"]["direct_loads"] == 2 and warm["counters"]["loads"] == 2
    assert warm["compiler_modules"] == []
    assert warm["sympy_imported"] is False, "loading entries and their value guards needs no sympy"


def test_loaded_entry_reads_live_weights(tiny_lm_warm):
    warm = tiny_lm_warm["hooks"]
    assert warm["mutated_equal"], "output after changing weights must equal eager with the new weights"
    assert warm["mutated_changed"], "changing weights must change the output"
    assert warm["hooks"]["inductor_compiles"] == 0 and warm["hooks"]["cpp_builds"] == 0


def test_without_the_c_extension_the_same_calls_run_in_python_with_the_same_results(tiny_lm_warm):
    """Where gearcache.call._callpath is not built (no C compiler at install) and the native checks are not either, the
    per-call path is the Python one with Dynamo's checks: same results, live weights, shortcut, and still nothing
    compiled."""
    native, python = tiny_lm_warm["hooks"], tiny_lm_warm["python"]
    # shortcut calls: decode twice more, prefill again (one shortcut per method); the prefill after the weight
    # changes re-checks the guards first (a new Parameter is a new graph input: its metadata is checked, the entry
    # rebound to it), off the shortcut
    assert native["call_path"] == {"native_entries": True, "dispatcher": "gearcache.call._callpath",
                                   "native_checks": True,
                                   "shortcut_calls": 3}
    assert python["call_path"] == {"native_entries": False, "dispatcher": "gearcache.call.dispatch",
                                   "native_checks": False, "shortcut_calls": 3}
    for report in (native, python):
        assert report["equal"] and report["repeat_equal"] and report["mutated_equal"] and report["mutated_changed"]
        assert report["hooks"]["inductor_compiles"] == 0 and report["counters"]["compiles"] == 0


def test_hooks_do_count_a_cold_compile(tiny_lm_cache):
    """The hooks are live: the same script on an empty gearcache folder (the session's cold run, hooks installed,
    empty Inductor and Triton caches) trips them."""
    _, cold = tiny_lm_cache
    assert cold["hooks"]["dynamo_frames"] >= 2
    assert cold["hooks"]["inductor_compiles"] >= 2
    assert cold["hooks"]["guard_builds"] >= 2
    if cold["device"] == "cpu":
        assert cold["hooks"]["cpp_builds"] >= 1
    else:
        assert cold["hooks"]["triton_compiles"] >= 1
