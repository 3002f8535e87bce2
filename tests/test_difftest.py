"""The differential tester (tests/difftest/): CI's slice of generated cases, and the tester's own parts.

CI's slice (``test_generated_cases_equal_eager_or_are_refused``) draws 300 cases (run seed 0) over 11 generated module
classes sharing one store, runs each against its eager twin in this process and again in fresh processes, and
asserts that every case equals eager or raises a gearcache error and that no entry was loaded stale. On failure the
message holds the counts, the coverage and a shrunk reproducer. The GPU long mode is
``python3 -m tests.difftest --cases 100 --device cuda --graphs`` (docs/RELIABILITY.md, "Differential tester").
"""
import copy
import json
import subprocess
import sys

import pytest
import torch

from difftest import draw, programs, repro, runner, session, shrink

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")

# features CI's slice must exercise (the draw is seeded: a change of the generator that drops one fails here)
REQUIRED_TAGS = ({f"block:{b}" for b in programs.BLOCKS} | {f"output:{o}" for o in programs.OUTPUTS} |
                 {"route:torch_compile", "gears:zip", "gears:product", "gears:marks", "gears:by_name",
                  "gears:padded-call", "gears:pad-value-nonzero", "past-largest:error", "past-largest:eager",
                  "dynamic:false", "decompositions", "warmup", "verify-padding", "input:non-contiguous",
                  "input:optional-None", "input:optional-tensor", "const:assigned-in-process", "const:file-edited",
                  "values:entry-shared-with-other-values", "side:main", "side:warm",
                  "data:pad-shown-after-first-call", "gears:pad-value-chosen"} |
                 {f"change:{k}" for k in runner.CHANGES} | {"change:before", "change:after"})
# features at least one case must show *equal* to eager (a gearcache that refused them all would pass otherwise)
REQUIRED_EQUAL = {"route:torch_compile", "gears:padded-call", "input:optional-None", "input:optional-tensor",
                  "input:int-scalar", "input:float-scalar", "input:non-contiguous", "dtype:bfloat16", "dtype:int64",
                  "const:assigned-in-process", "const:file-edited", "values:entry-shared-with-other-values",
                  "inplace:buffer", "inplace:input", "output:nested", "output:alias-input", "side:warm",
                  "pad:neutral", "pad:int", "data:pad-shown-after-first-call"} | {
    f"change:{k}" for k in runner.CHANGES} | {"change:before", "change:after"}


# ------------------------------------------------------------------------------------------------- CI's slice
@pytest.fixture(scope="module")
def slice_report(tmp_path_factory):
    return session.run_difftest(0, 300, tmp_path_factory.mktemp("difftest"), shrink=1, shrink_seconds=120)


@pytest.mark.slow
def test_generated_cases_equal_eager_or_are_refused(slice_report):
    report = slice_report
    print(report.summary())
    assert len(report.cases) >= 300
    assert {side: len(r) for side, r in report.results.items()} == {"main": 300, "warm": 300}
    ran = {tag for tag, outcomes in report.coverage().items() if sum(outcomes.values())}
    assert REQUIRED_TAGS <= ran, f"features no case exercised: {sorted(REQUIRED_TAGS - ran)}"
    shown = {tag for tag, outcomes in report.coverage().items() if outcomes["equal"]}
    assert REQUIRED_EQUAL <= shown, f"features no case showed equal to eager: {sorted(REQUIRED_EQUAL - shown)}"
    assert report.compile_identities <= 48
    failures = [f"case {f['id']} ({f['side']}): {f['outcome']} at {f['call']}: {f['detail']}"
                for f in report.failures]
    assert not failures, (f"{len(failures)} generated cases neither equal eager nor raise a gearcache error:\n"
                          f"{report.summary()}\nfirst: {failures[0]}\nreproducers: "
                          f"{json.dumps(report.reproducers, indent=1)}")
    assert not report.stale, f"{len(report.stale)} stale loads, e.g. {report.stale[:3]}"


# ------------------------------------------------------------------------------------------------- the parts
def test_compare_finds_every_kind_of_difference():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    def nested():
        return {"a": (t.clone(), [t.to(torch.bfloat16), None]), "n": 3, "s": "x", "f": 0.5, "i": torch.tensor([1, 2])}

    out: list[str] = []
    runner.compare(nested(), nested(), "output", out)
    assert out == []
    runner.compare(t + 1e-6, t, "o", out)
    assert out == [], "float32 within tolerance"
    cases = [(t + 1e-3, t, "values differ"), (t.double(), t, "float64"), (t[:1], t, "shape"),
             (torch.tensor([1, 3]), torch.tensor([1, 2]), "values differ"), ((t,), [t], "type tuple"),
             ({"a": t}, {"b": t}, "keys"), (None, t, "NoneType"), (4, 3, "4 != eager's 3"), ((t, t), (t,), "length"),
             (0.5001, 0.5, "!= eager's"), (torch.full((2,), float("nan")), torch.ones(2), "values differ")]
    for got, want, message in cases:
        out = []
        runner.compare(got, want, "o", out)
        assert out and message in out[0], (got, want, out)
    nan = torch.full((2,), float("nan"))
    out = []
    runner.compare(nan, nan.clone(), "o", out)
    assert out == [], "NaN equals NaN"


def test_compare_call_checks_inputs_buffers_and_parameters():
    model = torch.nn.Linear(2, 2)
    model.register_buffer("seen", torch.zeros(3))
    twin = copy.deepcopy(model)
    x = torch.ones(2)
    assert runner.compare_call(x, x.clone(), {"x": x}, {"x": x.clone()}, model, twin) == []
    model.seen[1] = 1.0                         # a buffer written by one side only
    with torch.no_grad():
        twin.weight[0, 0] += 1                  # a parameter
    diffs = runner.compare_call(x, x.clone(), {"x": x}, {"x": x + 1}, model, twin)
    assert [d.split(":")[0] for d in diffs] == ["input x", "module.seen", "module.weight"]


def test_every_block_and_output_renders_a_program_its_eager_twin_runs(tmp_path):
    """The grammar is valid: each block and each output, rendered and imported, runs eagerly on every kind of
    input (non-contiguous ones, an optional tensor and None) with every value of its attributes."""
    specs = [{"module": f"dtgrammar_{name}", "helper": f"dtgrammar_h_{name}", "blocks": [name], "output": "tuple"}
             for name in programs.BLOCKS]
    specs += [{"module": f"dtgrammar_o_{name}", "helper": f"dtgrammar_oh_{name}",
               "blocks": list(programs.OUTPUTS[name][1]), "output": name} for name in programs.OUTPUTS]
    session.write_sources(tmp_path, specs)
    for spec in specs:
        module = runner.load_program(tmp_path, spec)
        program = dict(spec, inputs=programs.inputs_of(spec))
        for pick in (0, 1):
            attrs = {k: draw._json(v[pick]) for k, v in programs.attrs_of(spec).items()}
            case = {"seed": 1, "program": program, "mask": pick == 1, "options": {}}
            call = {"B": 3, "noncontig": ["x", "y", "ids", "state"], "alpha": 0.5, "n": 1}
            persistent = {"compiled": torch.zeros(8, 16)}
            with torch.no_grad():
                out = module.Prog(**attrs).fwd(*runner.make_inputs(case, call, 0, persistent).values())
            assert out is not None


def test_draw_is_deterministic_covers_the_grammar_and_keeps_its_budget():
    progs, cases, ledger = draw.draw_run(3, 120, max_compiles=30, max_plans=12)
    again = draw.draw_run(3, 120, max_compiles=30, max_plans=12)
    assert (progs, cases) == again[:2]
    assert len(ledger.identities) <= 30 and len(ledger.plans) <= 12
    assert {b for p in progs for b in p["blocks"]} == set(programs.BLOCKS)
    assert {p["output"] for p in progs} == set(programs.OUTPUTS)
    assert len({c["seed"] for c in cases}) == len(cases)
    assert any("values:entry-shared-with-other-values" in c["tags"] for c in cases)
    for case in cases:
        json.dumps(case)                        # a case crosses processes as JSON


def test_constants_edited_between_processes_are_seen_by_a_module_reimported_in_the_same_second(tmp_path):
    """Warm batch 1 rewrites the program files with other constants (same length): the loader executes the new
    source, never a stale .pyc."""
    spec = {"module": "dtedit", "helper": "dtedit_h", "blocks": ["global_scale", "helper_fn"], "output": "plain"}
    session.write_sources(tmp_path, [spec])
    first = runner.load_program(tmp_path, spec)
    assert (first.SCALE, sys.modules["dtedit_h"].ALPHA) == (1.0, 0.1)
    session.write_sources(tmp_path, [spec], {"dtedit": draw.warm_consts(spec, 1)})
    again = runner.load_program(tmp_path, spec)
    assert (again.SCALE, sys.modules["dtedit_h"].ALPHA) == (3.0, 0.7)
    with runner.assigned(dict(spec), {"SCALE": 5.0, "helper.ALPHA": 0.2}):
        assert (again.SCALE, sys.modules["dtedit_h"].ALPHA) == (5.0, 0.2)
    assert (again.SCALE, sys.modules["dtedit_h"].ALPHA) == (3.0, 0.7)


def test_stale_loads_are_entries_first_used_by_other_values():
    program = {"module": "m", "helper": "h", "blocks": ["layernorm"], "output": "plain", "inputs": ["x"]}
    cases = [{"id": i, "program": program, "attrs": attrs, "assign": {}, "warm_batch": 0}
             for i, attrs in enumerate([{"eps": 1e-5}, {"eps": 0.1}, {"eps": 1e-5}])]
    results = {"main": {0: {"entries": ["e1"], "outcome": "equal"}, 1: {"entries": ["e1"], "outcome": "mismatch"},
                        2: {"entries": ["e1", "e2"], "outcome": "equal"}},
               "warm": {1: {"entries": ["e3"], "outcome": "equal"}}}
    stale, first = session.find_stale(cases, results)
    assert stale == [{"id": 1, "side": "main", "entry": "e1", "first_used_by": (0, "main"), "outcome": "mismatch"}]
    assert first == {"e1": (0, "main"), "e2": (2, "main"), "e3": (1, "warm")}


def test_a_call_past_the_largest_gear_is_a_refusal_not_a_failure(tmp_path):
    spec = {"module": "dtrefuse", "helper": "dtrefuse_h", "blocks": ["scale"], "output": "plain"}
    session.write_sources(tmp_path / "src", [spec])
    case = {"id": 0, "seed": 3, "program": dict(spec, inputs=["x"]), "attrs": {}, "assign": {},
            "options": {"route": "cache_compile", "past_largest": "error",
                        "gears": {"sizes": [2, 4], "declare": "marks", "policy": "zip", "pad": 0.0}},
            "calls": [{"B": 6}]}
    result = runner.run_case(case, tmp_path / "src", str(tmp_path / "store"))
    assert result["outcome"] == "refused"
    assert "PastLargestGearError" in result["detail"] and "size 6" in result["detail"]


@pytest.mark.slow
def test_a_known_bad_setup_is_reported_shrunk_and_reproduced(tmp_path):
    """A wrong custom decomposition (``aten.addmm`` without its bias) makes gearcache's answer differ from eager:
    the tester reports a mismatch (not an upstream bug: plain torch.compile gets it right), shrinks the case to the
    smallest program and calls that still fail, and writes a reproducer that fails again as a script."""
    spec = {"module": "dtbad", "helper": "dtbad_h", "blocks": ["scale", "buf_count", "alpha_scalar"],
            "output": "tuple"}
    case = {"id": 0, "seed": 5, "program": dict(spec, inputs=programs.inputs_of(spec)), "attrs": {"scale": 0.5},
            "assign": {}, "mask": False,
            "options": {"route": "cache_compile", "decompositions": "addmm_without_bias", "past_largest": "error",
                        "gears": {"sizes": [2, 4], "declare": "by_name", "policy": "product", "pad": 1.0}},
            "calls": [{"B": 3, "alpha": 2.0, "noncontig": ["x"]}, {"B": 4, "alpha": 0.5, "noncontig": []}]}
    session.write_sources(tmp_path / "src", [spec])
    result = runner.run_case(case, tmp_path / "src", str(tmp_path / "store"))
    assert result["outcome"] == "mismatch" and result["call"] == 0, result
    scenario = {"programs": [spec], "processes": [{"consts": {}, "cases": [dict(case, oracle=False)]}],
                "target": [0, 0], "expect": {"outcome": "mismatch", "family": shrink.family(result)},
                "title": "a wrong decomposition", "detail": result["detail"]}
    small, tried = shrink.shrink(scenario, tmp_path / "shrink", deadline=float("inf"))
    assert tried > 0
    kept = small["processes"][0]["cases"][0]
    assert small["programs"][0]["blocks"] == [] and small["programs"][0]["output"] == "plain"
    assert len(kept["calls"]) == 1 and kept["options"]["gears"] is None and kept["attrs"] == {}
    assert kept["options"]["decompositions"] == "addmm_without_bias", "the cause is kept"
    script = tmp_path / "repro.py"
    script.write_text(repro.render_script(small))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "-> mismatch output" in done.stdout


PAD_CASES = [          # blocks of programs.PAD_BLOCKS, and how gearcache must answer
    (["pad_amin", "ids_min"], None), (["pad_amax", "pad_argmax", "ids_max"], None),
    (["pad_neg_min", "pad_softmax", "pad_logsumexp"], None), (["pad_sum", "pad_prod"], None),
    (["pad_mean"], "PaddingUnsafeError: aten.mean: reduces over a padded dim"), (["fresh_rows", "pad_sum"], None),
    (["pad_amin", "pad_amax"], "exact only if its padded rows hold +inf, but they hold -inf"),
    (["ids_input", "ids_min"], "PaddingUnsafeError: aten."), (["fresh_rows", "pad_amin"], "PaddingUnsafeError: aten."),
]


@pytest.mark.slow
def test_reductions_over_the_geared_dim_equal_eager_on_data_that_shows_a_wrong_pad(tmp_path):
    """The tester's pad-value-sensitive blocks, each geared (gear 4, calls of 3 and 2 rows) with no pad value given:
    the first call's mixed data would hide a wrong pad from a min or a max (one checked call passed them before), the
    later all-positive or all-negative calls show it. A min, max, argmax, softmax, log-sum-exp, sum or product over
    the geared dim, negated, scaled or of int64 ids, and rows [:B] of a tensor the method makes, equal eager; a mean,
    a min and a max of one input, ids read both as an index and by a min, and rows [:B] written with the +inf a min
    needs are refused, naming the op."""
    specs = [{"module": f"dtpad_{k}", "helper": f"dtpad_h_{k}", "blocks": blocks, "output": "tuple"}
             for k, (blocks, _) in enumerate(PAD_CASES)]
    session.write_sources(tmp_path / "src", specs)
    for k, (spec, (_, refusal)) in enumerate(zip(specs, PAD_CASES)):
        case = {"id": k, "seed": 11 + k, "program": dict(spec, inputs=programs.inputs_of(spec)), "attrs": {},
                "assign": {}, "mask": False, "oracle": False,
                "options": {"route": "cache_compile", "past_largest": "error",
                            "gears": {"sizes": [4], "declare": "by_name", "policy": "zip", "pad": None}},
                "calls": [{"B": 3, "data": "mixed"}, {"B": 3, "data": "positive"}, {"B": 2, "data": "negative"}]}
        result = runner.run_case(case, tmp_path / "src", str(tmp_path / "store"))
        if refusal is None:
            assert result["outcome"] == "equal" and result["counters"]["pads"] == 3, (spec["blocks"], result)
        else:
            assert result["outcome"] == "refused" and result["call"] == "call 0", (spec["blocks"], result)
            assert refusal in session.refusal_reason(result["detail"]), (spec["blocks"], result["detail"])


@needs_cuda
def test_cuda_graph_cases_equal_eager_or_are_refused(tmp_path):
    """A short GPU run with mode="reduce-overhead" (every graph_outputs and capture_graphs choice, bfloat16 and float32
    models); each case it refuses is run again on the CPU, and none of those may equal eager there. The long mode is
    ``python3 -m tests.difftest --cases 100 --device cuda --graphs``."""
    report = session.run_difftest(1, 40, tmp_path, device="cuda", graphs=True, shrink=1)
    print(report.summary())
    assert sum("cuda-graphs" in c["tags"] for c in report.cases) >= 35
    assert not report.failures, report.summary()
    assert not report.stale
    assert not report.gpu_only_refusals, "a refusal on the GPU whose CPU twin equals eager: " + report.summary()
