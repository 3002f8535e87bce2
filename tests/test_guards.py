"""gearcache/keys/guards_from_dynamo.py, guard_sets.py, guard_paths.py, guard_fingerprints.py, dynamo_sources.py:
Dynamo's guards as value guards that mean the same in every process (no compiles here: Dynamo traces with a backend
that records, nothing is compiled)."""
from __future__ import annotations

import enum
import functools
import json
import sys
import types

import pytest
import torch

from gearcache._torch import capture as torch_capture, guards as torch_guards, state as torch_state
from gearcache.keys import guard_watch
from gearcache.keys import dynamo_sources
from gearcache.keys import fingerprints
from gearcache.keys import guard_fingerprints
from gearcache.keys import guard_paths
from gearcache.keys import guard_sets
from gearcache.keys import guards_from_dynamo
from gearcache.keys import value_guard
from gearcache.call import signature
from gearcache.errors import UnguardableError, Unpersistable

SCALE = 3.0
SIZES = [1, 2]


class Mode(enum.Enum):
    A = 1
    B = 2


def _closure(k):
    def f(x):
        return x * k
    return f


class Sub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = 0.5

    def forward(self, x):
        return x * self.p


class Model(torch.nn.Module):
    def __init__(self, heads=4, eps=1e-5):
        super().__init__()
        self.heads = heads
        self.lin = torch.nn.Linear(8, 8)
        self.ln = torch.nn.LayerNorm(8, eps=eps)
        self.mode = Mode.A
        self.fn = _closure(2.0)
        self.subs = torch.nn.ModuleList([Sub(), Sub()])

    def forward(self, x):
        h = self.ln(self.lin(x)) * SCALE + self.fn(x) + SIZES[1]
        if self.mode is Mode.A:
            h = h + 1
        for s in self.subs:
            h = s(h)
        return h.view(x.shape[0], self.heads, -1).sum(-1)


def capture_guards(method, *args) -> guard_sets.GuardSet:
    recording = torch_guards.GuardRecording()

    def record(gm, example_inputs):
        return gm

    code = method.__func__.__code__
    try:
        with torch.no_grad():
            torch.compile(method, fullgraph=True, dynamic=False, backend=record,
                          options=torch_guards.guard_recording_options(recording, method.__func__.__globals__))(*args)
    finally:
        torch_capture.forget_dynamo_cache(code)
    return guards_from_dynamo.from_dynamo(recording, method)


@pytest.fixture(scope="module")
def model_and_guards():
    torch.manual_seed(0)
    model = Model()
    return model, capture_guards(model.forward, torch.randn(2, 8))


def scope_of(model) -> guard_paths.Scope:
    return guard_paths.Scope(model, Model.forward.__globals__)


def texts(gs: guard_sets.GuardSet, kind: str) -> set[str]:
    return {g.text() for g in gs.guards if g.kind == kind}


def test_guards_name_every_python_value_the_graph_bakes_in(model_and_guards):
    _, gs = model_and_guards
    assert gs.local is None
    values = texts(gs, "value")
    for expected in ("self.heads", "self._modules['ln'].eps", "SCALE", "SIZES[1]",
                     "self.fn.__closure__[0].cell_contents", "self._modules['subs']._modules['0'].p"):
        assert expected in values, sorted(values)
    assert "self.mode" in texts(gs, "identity")
    assert "self.fn" in texts(gs, "identity")
    assert not any(g.path[0] == "self" and g.text() == "x" for g in gs.guards)     # arguments: the signature's


def test_every_guard_holds_on_the_objects_it_was_captured_from(model_and_guards):
    model, gs = model_and_guards
    assert gs.mismatch(scope_of(model)) is None


@pytest.mark.parametrize("change, where", [
    (lambda m: setattr(m.ln, "eps", 0.1), "self._modules['ln'].eps"),
    (lambda m: setattr(m, "heads", 2), "self.heads"),
    (lambda m: setattr(m.subs[1], "p", 0.7), "self._modules['subs']._modules['1'].p"),
    (lambda m: setattr(m, "mode", Mode.B), "self.mode"),
    (lambda m: setattr(m, "fn", _closure(5.0)), "self.fn"),       # a function's fingerprint holds its closure
    (lambda m: setattr(m.subs[0], "forward", lambda x: x), "self._modules['subs']._modules['0']"),
    (lambda m: m.lin.register_forward_hook(lambda *a: None), "self._modules['lin']._forward_hooks"),
])
def test_a_changed_value_is_named_by_the_mismatch(change, where):
    torch.manual_seed(0)
    model = Model()
    gs = capture_guards(model.forward, torch.randn(2, 8))
    change(model)
    mismatch = gs.mismatch(scope_of(model))
    assert mismatch is not None and mismatch.guard.text() == where, mismatch


def test_globals_of_this_and_other_modules_are_guarded(model_and_guards, monkeypatch):
    model, gs = model_and_guards
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 1.0)
    assert "SCALE" in str(gs.mismatch(scope_of(model)))
    monkeypatch.undo()
    SIZES[1] = 7
    try:
        assert "SIZES[1]" in str(gs.mismatch(scope_of(model)))
    finally:
        SIZES[1] = 2


def test_json_round_trip_and_a_fresh_process_reading(model_and_guards):
    """The on-disk form is plain JSON; read back, it is the same guards and checks the same."""
    model, gs = model_and_guards
    text = json.dumps(gs.to_json())
    again = guard_sets.GuardSet.from_json(json.loads(text))
    assert again.guards == gs.guards
    assert again.mismatch(scope_of(model)) is None
    model.heads = 8
    try:
        assert "self.heads" in str(again.mismatch(scope_of(model)))
    finally:
        model.heads = 4


def test_variants_of_one_signature_get_one_key_per_guarded_values(model_and_guards):
    model, gs = model_and_guards
    scope = scope_of(model)
    first = guard_sets.variant_key("k" * 40, gs, scope)
    assert guard_sets.variant_key("k" * 40, gs, scope) == first
    model.heads = 8
    try:
        assert guard_sets.variant_key("k" * 40, gs, scope) != first
    finally:
        model.heads = 4


def test_choose_takes_the_record_whose_guards_hold(model_and_guards):
    model, gs = model_and_guards
    scope = scope_of(model)
    records = {"e0": {"guards": gs.to_json(), "name": "first"}}
    found = guard_sets.choose(records.get, "e0", scope)
    assert found.record["name"] == "first" and found.key == "e0" and found.mismatch is None
    model.heads = 8
    try:
        miss = guard_sets.choose(records.get, "e0", scope)
        assert miss.record is None and miss.key != "e0" and "self.heads" in str(miss.mismatch)
        records[miss.key] = {"guards": capture_guards(model.forward, torch.randn(2, 8)).to_json(), "name": "8"}
        assert guard_sets.choose(records.get, "e0", scope).record["name"] == "8"
    finally:
        model.heads = 4
    assert guard_sets.choose(records.get, "e0", scope).record["name"] == "first"


def test_fingerprints_are_stable_names_not_addresses():
    assert guard_fingerprints.identity_fp(torch.nn.functional.relu)[:2] == ["function", "torch.nn.functional.relu"]
    assert guard_fingerprints.identity_fp(torch.nn.functional.linear) == ["builtin", "torch._C._nn.linear"]
    assert guard_fingerprints.identity_fp(types) == ["module", "types"]
    assert guard_fingerprints.identity_fp(Mode.A) == ["enum", f"{__name__}.Mode", "A"]
    assert guard_fingerprints.value_fp(1e-5) == ["float", "1e-05"]
    assert guard_fingerprints.value_fp(True) == ["bool", True]
    assert guard_fingerprints.value_fp(torch.Size([2, 3])) == ["torch.Size", [["int", 2], ["int", 3]]]
    partial = functools.partial(torch.add, alpha=2)
    assert guard_fingerprints.identity_fp(partial)[0] == "partial"
    with pytest.raises(Unpersistable):
        guard_fingerprints.identity_fp(object())


def test_code_digest_ignores_where_the_code_is_but_not_what_it_does():
    def f(x):
        return x + 1

    def g(x):
        return x + 1

    def h(x):
        return x + 2

    assert fingerprints.code_digest(f.__code__) == fingerprints.code_digest(g.__code__)
    assert fingerprints.code_digest(f.__code__) != fingerprints.code_digest(h.__code__)


def test_an_object_known_only_by_identity_makes_the_guards_local():
    """Dynamo guards some objects by identity alone (ID_MATCH on an instance): no fingerprint means the same in another
    process, so the entry is local (checked by identity in this process, never stored)."""
    holder = torch.nn.Module()
    holder.token = object()
    method = types.MethodType(lambda self, x: x, holder)
    dynamo_guard = torch_guards.DynamoGuard("ID_MATCH", "L['self'].token", True, holder.token, {})
    gs = guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dynamo_guard]), method)
    assert gs.local is not None and "known only by its identity" in gs.local
    with pytest.raises(Unpersistable):
        gs.to_json()
    scope = guard_paths.Scope(holder, {})
    assert gs.mismatch(scope) is None
    holder.token = object()
    assert gs.mismatch(scope) is not None


@pytest.mark.parametrize("source, path", [
    ("L['self']._modules['ln'].eps", (("L", "self"), ("attr", "_modules"), ("item", "ln"), ("attr", "eps"))),
    ("G['SCALE']", (("G", "SCALE"),)),
    ("type(G['c']).__mro__[1]", (("G", "c"), ("type",), ("attr", "__mro__"), ("item", 1))),
    ("dict(type(G['c']).__dict__)['f']", (("G", "c"), ("type",), ("attr", "__dict__"), ("item", "f"))),
    ("dict.__getitem__(G['d'], list(dict.keys(G['d']))[2])", (("G", "d"), ("item_at", 2))),
    ("list(dict.keys(G['d']))[0]", (("G", "d"), ("key_at", 0))),
    ("object.__getattribute__(L['self']._modules['model'], 'config').vocab_size",      # Dynamo 2.11
     (("L", "self"), ("attr", "_modules"), ("item", "model"), ("generic_attr", "config"), ("attr", "vocab_size"))),
    ("L['self'].fn.__closure__[0].cell_contents",
     (("L", "self"), ("attr", "fn"), ("attr", "__closure__"), ("item", 0), ("attr", "cell_contents"))),
])
def test_dynamos_source_expressions_parse_into_paths(source, path):
    assert dynamo_sources.parse_source(source) == path


@pytest.mark.parametrize("source", ["___tuple_iterator_getitem(G['it'], 0)", "G['x'][G['i']]", "L['a'] + 1"])
def test_other_source_forms_are_refused_not_guessed(source):
    with pytest.raises(Unpersistable):
        dynamo_sources.parse_source(source)


def test_a_guard_on_a_torch_module_this_process_has_not_imported_holds_without_importing_it():
    """Dynamo's traces import helpers of torch's own (torch._dynamo.polyfills); a warm process never imports them:
    their guards hold without a check (the torch version is a key factor), and checking them imports nothing."""
    name = "torch._gearcache_never_imported"
    guard = value_guard.ValueGuard("value", (("module", name), ("attr", "flag")), None, ["bool", True])
    scope = guard_paths.Scope(torch.nn.Linear(1, 1), {})
    assert guard_sets.unloaded_torch_module(guard)
    assert guard_sets.GuardSet([guard]).mismatch(scope) is None
    assert guard_sets.GuardSet([guard]).live_fingerprints(scope) == [["bool", True]]
    assert name not in sys.modules
    other = value_guard.ValueGuard("value", (("module", "json"), ("attr", "flag")), None, ["bool", True])
    assert not guard_sets.unloaded_torch_module(other), "only torch's own modules"


def test_a_generic_attribute_step_reads_past_a_custom_getattribute():
    """``object.__getattribute__(x, name)`` (Dynamo's GenericAttrSource) reads the instance's own attribute even where
    the class answers attribute reads otherwise; the step does the same."""
    class Answers:
        def __init__(self):
            self.size = 3

        def __getattribute__(self, name):
            return 99 if name == "size" else object.__getattribute__(self, name)

    obj = Answers()
    assert obj.size == 99
    assert guard_paths.step(obj, ("generic_attr", "size")) == 3
    assert guard_paths.path_text((("global", "cfg"), ("generic_attr", "size"))) == "cfg.size"


# ------------------------------------------------------------------------------------------------ one test per row
# docs/DESIGN.md, "Value guards", lists every guard kind Dynamo emits and what gearcache does with it: a value guard
# of some kind (re-checked across processes, watched per call), the signature key or the global-state key, or refused.
# The tests below check one row each.

def _design_rows() -> dict[str, str]:
    """Guard kind -> what the table says gearcache does (its second column)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "DESIGN.md").read_text()
    section = text[text.index("## Value guards"):]
    section = section[:section.index("\n## ", 3)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            for name in cells[0].replace("`", "").split(","):
                rows[name.strip()] = cells[1]
    return rows


def _installed_guard_kinds() -> set[str]:
    from torch._dynamo.guards import GuardBuilder

    return {name for name in vars(GuardBuilder) if name.isupper() and callable(getattr(GuardBuilder, name))}


def test_the_design_table_lists_every_guard_kind_and_what_gearcache_does_with_it():
    rows = _design_rows()
    handled = set(guards_from_dynamo._KINDS) | set(guards_from_dynamo._ELSEWHERE) | set(guards_from_dynamo._REFUSED)
    assert _installed_guard_kinds() <= handled, "a guard kind of this torch that gearcache does not handle"
    assert handled <= set(rows), sorted(handled - set(rows))
    for kind in handled:
        if kind in guards_from_dynamo._REFUSED:
            assert "refused" in rows[kind], kind
        elif kind in guards_from_dynamo._ELSEWHERE:
            assert guards_from_dynamo._ELSEWHERE[kind] in rows[kind], kind
        else:
            assert f"`{guards_from_dynamo._KINDS[kind] if kind != 'NN_MODULE' else 'live'}`" in rows[kind], kind


def test_a_guard_kind_this_gearcache_does_not_know_is_refused():
    holder = torch.nn.Module()
    holder.n = 3
    dg = torch_guards.DynamoGuard("SOME_FUTURE_MATCH", "L['self'].n", True, 3, {})
    with pytest.raises(UnguardableError, match="SOME_FUTURE_MATCH"):
        guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), types.MethodType(lambda self, x: x, holder))


MODE_CLS = torch.nn.ReLU


def _twice(x, k=2.0):
    return x * k


class Kinds(torch.nn.Module):
    """A forward whose capture makes Dynamo emit most guard kinds on its own."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.n, self.eps, self.t, self.mode = 3, 1e-5, (1, 2), Mode.A
        self.table, self.s, self.items = {"a": 1}, {1, 2}, [1, 2]
        self.size = torch.Size([2, 4])
        self.maybe = torch.nn.ReLU()

    def forward(self, x):
        y = self.lin(x) * self.n * SCALE + _twice(x) + getattr(self, "extra", 0.0)
        if self.mode is Mode.A:
            y = y * 2
        if "a" in self.table:
            y = y + self.table["a"]
        if 1 in self.s:
            y = y + 1
        for v in self.table.values():
            y = y + v
        y = y + len(self.items) + self.eps + self.t[1]
        if isinstance(self.maybe, MODE_CLS):
            y = y + 1
        return (y + torch.nn.functional.relu(x)).view(self.size)


def _record(method, *args) -> torch_guards.GuardRecording:
    recording = torch_guards.GuardRecording()
    code = method.__func__.__code__
    try:
        with torch.no_grad():
            torch.compile(method, fullgraph=True, dynamic=False, backend=lambda gm, ex: gm,
                          options=torch_guards.guard_recording_options(recording, method.__func__.__globals__))(*args)
    finally:
        torch_capture.forget_dynamo_cache(code)
    return recording


def _restore(obj, name):
    old = getattr(obj, name)
    return lambda: setattr(obj, name, old)


# Dynamo kind, the source Dynamo guards, the change (returns an undo or None)
NATURAL = [
    ("CONSTANT_MATCH", "L['self'].eps", lambda m: setattr(m, "eps", 1e-3)),   # torch 2.11: EQUALS_MATCH for .n
    ("EQUALS_MATCH", "L['self'].table['a']", lambda m: m.table.__setitem__("a", 5)),
    ("ID_MATCH", "L['self'].mode", lambda m: setattr(m, "mode", Mode.B)),
    ("CLASS_MATCH", "G['MODE_CLS']", lambda m: (_restore(sys.modules[__name__], "MODE_CLS"),
                                                setattr(sys.modules[__name__], "MODE_CLS", torch.nn.GELU))[0]),
    ("CLOSURE_MATCH", "G['_twice']", lambda m: (_restore(_twice, "__defaults__"),
                                                 setattr(_twice, "__defaults__", (3.0,)))[0]),
    ("MODULE_MATCH", "G['torch']", lambda m: (_restore(sys.modules[__name__], "torch"),
                                               setattr(sys.modules[__name__], "torch", types))[0]),
    ("BUILTIN_MATCH", ".F.linear", lambda m: (_restore(torch.nn.functional, "linear"),
                                              setattr(torch.nn.functional, "linear", lambda *a: None))[0]),
    ("SEQUENCE_LENGTH", "L['self'].items", lambda m: m.items.append(3)),
    ("DICT_KEYS_MATCH", "L['self'].table", lambda m: m.table.__setitem__("b", 2)),
    ("DICT_CONTAINS", "L['self'].table", lambda m: m.table.pop("a") and None),
    ("SET_CONTAINS", "L['self'].s", lambda m: m.s.discard(1)),
    ("TYPE_MATCH", "L['self']._modules['maybe']", lambda m: setattr(torch.nn.ReLU, "extra_attr", 1) or
     (lambda: delattr(torch.nn.ReLU, "extra_attr"))),
    ("HASATTR", "L['self']", lambda m: setattr(m, "extra", 1.0)),
    ("NOT_PRESENT_IN_GENERIC_DICT", "L['self']._modules['lin']", lambda m: setattr(m.lin, "forward", lambda x: x)),
    ("EMPTY_NN_MODULE_HOOKS_DICT", "L['self']._modules['lin']._forward_hooks",
     lambda m: m.lin.register_forward_hook(lambda *a: None).remove and None),
    ("TENSOR_MATCH", "L['self']._modules['lin']._parameters['weight']",
     lambda m: setattr(m.lin.weight, "data", m.lin.weight.data.t().contiguous().t())),
    ("DUPLICATE_INPUT", "G['torch'].nn.functional", lambda m: (_restore(torch.nn, "functional"),
                                                                setattr(torch.nn, "functional", types))[0]),
]


@pytest.mark.parametrize("kind, source, change", NATURAL, ids=[row[0] for row in NATURAL])
def test_a_guard_dynamo_emits_is_re_checked_and_watched(kind, source, change):
    """The row's Dynamo guard is recorded on the source; after the change, the value guards no longer hold (a load
    in another process would not take the entry) and the watch built before the change says so (the next call in
    this process re-checks)."""
    torch.manual_seed(0)
    model = Kinds()
    method = model.forward
    recording = _record(method, torch.randn(2, 4))
    assert any(dg.kind == kind and source in dg.source for dg in recording.guards), \
        sorted({(dg.kind, dg.source) for dg in recording.guards})
    gs = guards_from_dynamo.from_dynamo(recording, method, passed={"x"})
    scope = guard_paths.Scope(model, method.__func__.__globals__, method.__func__)
    assert gs.local is None and gs.mismatch(scope) is None
    watch = guard_watch.watch([gs], scope)
    assert watch.valid()
    undo = change(model)
    try:
        assert gs.mismatch(scope) is not None, f"{kind}: the change is not seen across processes"
        assert not watch.valid(), f"{kind}: the change is not seen in this process"
    finally:
        if undo is not None:
            undo()


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.flag, self.opt, self.obj, self.d = True, None, torch.nn.ReLU(), {"a": 1}
        self.f = _twice
        self.ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
        self.i = 7


# Dynamo kind (emitted by Dynamo for programs that are hard to write small), source, detail, expected gearcache kind,
# the change
SYNTHETIC = [
    ("BOOL_MATCH", "L['self'].flag", {}, "value", lambda h: setattr(h, "flag", False)),
    ("NONE_MATCH", "L['self'].opt", {}, "value", lambda h: setattr(h, "opt", 0)),
    ("NOT_NONE_MATCH", "L['self'].obj", {}, "not_none", lambda h: setattr(h, "obj", None)),
    ("CONSTANT_SUBCLASS_MATCH", "L['self'].i", {}, "value", lambda h: setattr(h, "i", 8)),
    ("DICT_VERSION", "L['self'].d", {}, "value", lambda h: h.d.__setitem__("a", 2)),
    ("DISPATCH_KEY_SET_MATCH", "L['self'].ks", {}, "value",
     lambda h: setattr(h, "ks", torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA))),
    ("FUNCTION_MATCH", "L['self'].f", {}, "identity", lambda h: setattr(h, "f", _make_twice(4.0))),
    ("DICT_LENGTH", "L['self'].d", {}, "length", lambda h: h.d.__setitem__("b", 2)),
    ("MAPPING_KEYS_CHECK", "L['self'].d", {}, "keys", lambda h: h.d.__setitem__("c", 2)),
    ("DICT_KEYS", "L['self'].d", {}, "keys", lambda h: h.d.pop("a")),
    ("DICT_NOT_CONTAINS", "L['self'].d", {"key": "z", "invert": True}, "contains",
     lambda h: h.d.__setitem__("z", 1)),
    ("SET_NOT_CONTAINS", "L['self'].d", {"key": "q", "invert": True}, "contains",
     lambda h: h.d.__setitem__("q", 1)),
    ("FAKE_SCRIPT_TYPE_MATCH", "L['self'].obj", {}, "type", lambda h: setattr(h, "obj", torch.nn.GELU())),
]


def _make_twice(k):
    def twice(x, k=k):
        return x * k
    return twice


@pytest.mark.parametrize("kind, source, detail, gkind, change", SYNTHETIC, ids=[row[0] for row in SYNTHETIC])
def test_a_guard_kind_dynamo_emits_rarely_is_re_checked_and_watched(kind, source, detail, gkind, change):
    holder = Holder()
    method = types.MethodType(lambda self, x: x, holder)
    value = guard_paths.evaluate(("self",) + dynamo_sources.parse_source(source)[1:], guard_paths.Scope(holder, {}))
    dg = torch_guards.DynamoGuard(kind, source, True, value, detail)
    gs = guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), method)
    assert [g.kind for g in gs.guards] == [gkind] and gs.local is None
    scope = guard_paths.Scope(holder, {})
    watch = guard_watch.watch([gs], scope)
    assert gs.mismatch(scope) is None and watch.valid()
    change(holder)
    assert gs.mismatch(scope) is not None and not watch.valid()


def test_a_module_the_graph_specialises_on_is_checked_by_identity_in_this_process_only():
    """``NN_MODULE``: Dynamo holds the module's weights in the graph: only this object may be served it."""
    holder = Holder()
    dg = torch_guards.DynamoGuard("NN_MODULE", "L['self'].obj", True, holder.obj, {})
    gs = guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), types.MethodType(lambda self, x: x, holder))
    assert gs.local is not None and [g.kind for g in gs.guards] == ["live"]
    scope = guard_paths.Scope(holder, {})
    assert gs.mismatch(scope) is None
    holder.obj = torch.nn.ReLU()                        # the same class, another object
    assert gs.mismatch(scope) is not None


@pytest.mark.parametrize("kind", sorted(guards_from_dynamo._REFUSED))
def test_a_guard_no_entry_can_be_served_under_is_refused_with_the_fix(kind):
    holder = Holder()
    dg = torch_guards.DynamoGuard(kind, "L['self'].obj", True, holder.obj, {})
    with pytest.raises(UnguardableError, match=kind) as err:
        guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), types.MethodType(lambda self, x: x, holder))
    assert guards_from_dynamo._REFUSED[kind] in str(err.value)


def _key_state_changes():
    """Guard kind -> a context under which the key's global state differs from outside it."""
    import contextlib

    from torch.overrides import TorchFunctionMode

    class Mode_(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def default_device():
        with torch.device("meta"):
            yield

    @contextlib.contextmanager
    def deterministic():
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)

    @contextlib.contextmanager
    def in_vmap():
        box = {}
        torch.vmap(lambda t: box.setdefault("state", torch_state.global_state()) and t)(torch.ones(2, 1))
        yield box["state"]

    import torch.autograd.forward_ad as fwad

    return {"DETERMINISTIC_ALGORITHMS": deterministic, "GLOBAL_STATE": lambda: torch.autocast("cpu"),
            "TORCH_FUNCTION_STATE": torch._C.DisableTorchFunction, "DEFAULT_DEVICE": default_device,
            "TORCH_FUNCTION_MODE_STACK": Mode_, "FUNCTORCH_STACK_MATCH": in_vmap, "DUAL_LEVEL": fwad.dual_level}


@pytest.mark.parametrize("kind", sorted(k for k, v in guards_from_dynamo._ELSEWHERE.items() if v == "key"))
def test_a_guard_on_global_state_is_the_keys(kind):
    """No value guard: the entry key's ``global_state`` factor differs under the state Dynamo guards (and the
    signature key holds grad mode and every size: ``GRAD_MODE``, ``SHAPE_ENV``)."""
    holder = Holder()
    dg = torch_guards.DynamoGuard(kind, "", False, None, {})
    method = types.MethodType(lambda self, x: x, holder)
    assert len(guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), method)) == 0
    if kind == "GRAD_MODE":
        with torch.no_grad():
            off = signature.call_key((torch.ones(2),), {})[1]
        assert signature.call_key((torch.ones(2),), {})[1] != off
        return
    if kind == "SHAPE_ENV":
        assert signature.call_key((torch.ones(2),), {})[1] != signature.call_key((torch.ones(3),), {})[1]
        return
    outside = torch_state.global_state()
    with _key_state_changes()[kind]() as inside:
        state = inside if isinstance(inside, dict) else torch_state.global_state()
    assert state != outside, kind


def test_a_guard_on_saved_tensor_hooks_needs_no_check_for_inference_only_entries():
    """``AUTOGRAD_SAVED_TENSORS_HOOKS``: nothing is saved for backward in an inference-only call (grad off, or no
    input or weight requiring grad: a call that would record autograd raises GradModeError,
    tests/test_cached_function.py), so a hook could not fire in eager either."""
    assert guards_from_dynamo._ELSEWHERE["AUTOGRAD_SAVED_TENSORS_HOOKS"] == "inference"
    x = torch.ones(2, requires_grad=True)
    fired = []
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: fired.append(1) or t, lambda t: t):
        (x * x).sum()
    assert not fired


# ----------------------------------------------------------------------------------- guards on the call's arguments
def _method(fn, holder=None):
    return types.MethodType(fn, holder if holder is not None else Holder())


def test_a_guard_on_a_passed_argument_is_the_signature_keys():
    method = _method(lambda self, x, n=2: x * n)
    for kind, source in (("CONSTANT_MATCH", "L['n']"), ("TENSOR_MATCH", "L['x']"), ("SEQUENCE_LENGTH", "L['n']"),
                         ("DUPLICATE_INPUT", "L['x']")):
        dg = torch_guards.DynamoGuard(kind, source, True, 2, {"other": "L['n']"})
        assert len(guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), method, passed={"x",
                                                                                                     "n"})) == 0, kind


def test_an_attribute_of_an_argument_is_in_no_key_and_refused():
    method = _method(lambda self, x: x)
    dg = torch_guards.DynamoGuard("CONSTANT_MATCH", "L['x'].foo", True, 1, {})
    with pytest.raises(UnguardableError, match="attribute of an argument"):
        guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), method, passed={"x"})


def test_an_argument_that_is_also_a_module_buffer_is_refused():
    holder = Holder()
    holder.register_buffer("buf", torch.ones(2))
    dg = torch_guards.DynamoGuard("DUPLICATE_INPUT", "L['self']._buffers['buf']", True, holder.buf, {"other": "L['x']"})
    with pytest.raises(UnguardableError, match="clone"):
        guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), _method(lambda self, x: x, holder),
                                       passed={"x"})


def test_a_default_the_call_did_not_pass_is_guarded_on_the_function():
    def fwd(self, x, scale=2.0):
        return x * scale
    holder = Holder()
    method = types.MethodType(fwd, holder)
    dg = torch_guards.DynamoGuard("CONSTANT_MATCH", "L['scale']", True, 2.0, {})
    gs = guards_from_dynamo.from_dynamo(torch_guards.GuardRecording([dg]), method, passed={"x"})
    assert [g.path for g in gs.guards] == [(("default", "scale"),)]
    scope = guard_paths.Scope(holder, {}, fwd)
    watch = guard_watch.watch([gs], scope)
    fwd.__defaults__ = (3.0,)
    assert "scale" in str(gs.mismatch(scope)) and not watch.valid()


def test_a_closure_variable_of_the_cached_method_is_guarded_on_its_cell():
    """Issue #35: a model class built by a factory reads ``scale`` from its method's closure; Dynamo names it
    ``L['scale']`` like an argument."""
    def factory(scale):
        def fwd(self, x):
            return x * scale

        def set_scale(v):
            nonlocal scale
            scale = v
        return fwd, set_scale

    fwd, set_scale = factory(2.0)
    holder = Holder()
    recording = _record(types.MethodType(fwd, holder), torch.ones(2))
    gs = guards_from_dynamo.from_dynamo(recording, types.MethodType(fwd, holder), passed={"x"})
    assert (("closure", "scale"),) in [g.path for g in gs.guards]
    scope = guard_paths.Scope(holder, {}, fwd)
    watch = guard_watch.watch([gs], scope)
    assert gs.mismatch(scope) is None and watch.valid()
    set_scale(5.0)
    assert "scale" in str(gs.mismatch(scope)) and not watch.valid()
    same, _ = factory(2.0)
    assert gs.mismatch(guard_paths.Scope(holder, {}, same)) is None, "another process's factory with the same scale"


def test_a_function_patched_without_defaults_is_a_mismatch_not_a_crash():
    """Issue #35: the graph inlines a function whose defaults Dynamo guards (``len(f.__defaults__)``); the function
    is replaced by one without defaults: the lookup answers "no", it does not raise."""
    model = Kinds()
    recording = _record(model.forward, torch.randn(2, 4))
    gs = guards_from_dynamo.from_dynamo(recording, model.forward, passed={"x"})
    scope = guard_paths.Scope(model, Kinds.forward.__globals__, Kinds.forward)

    def no_defaults(x, *rest):
        return x * 3
    module = sys.modules[__name__]
    module._twice = no_defaults
    try:
        assert gs.mismatch(scope) is not None
        assert len(gs.live_fingerprints(scope)) == len(gs)
    finally:
        module._twice = _twice


def test_hook_dicts_of_called_modules_and_torchs_global_hooks_are_guarded():
    """Dynamo drops its own guards on empty hook dicts (``skip_nnmodule_hook_guards``) and guards torch's global
    hooks by type only: gearcache guards the length of each, for every module whose ``__call__`` the graph went
    through."""
    model = Kinds()
    gs = guards_from_dynamo.from_dynamo(_record(model.forward, torch.randn(2, 4)), model.forward, passed={"x"})
    lengths = {guard_paths.path_text(g.path) for g in gs.guards if g.kind == "length"}
    for name in guards_from_dynamo.MODULE_HOOK_DICTS:
        assert f"self._modules['lin'].{name}" in lengths, name
    for name in guards_from_dynamo.GLOBAL_HOOK_DICTS:
        assert f"torch.nn.modules.module.{name}" in lengths, name
    scope = guard_paths.Scope(model, Kinds.forward.__globals__, Kinds.forward)
    watch = guard_watch.watch([gs], scope)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        assert gs.mismatch(scope) is not None and not watch.valid()
    finally:
        handle.remove()
