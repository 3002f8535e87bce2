"""gearcache/guards.py: Dynamo's guards as value guards that mean the same in every process (no compiles here:
Dynamo traces with a backend that records, nothing is compiled)."""
from __future__ import annotations

import enum
import functools
import json
import sys
import types

import pytest
import torch

from gearcache import _torch_compat as compat
from gearcache import guards
from gearcache.errors import Unpersistable

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


def capture_guards(method, *args) -> guards.GuardSet:
    recording = compat.GuardRecording()

    def record(gm, example_inputs):
        return gm

    code = method.__func__.__code__
    try:
        with torch.no_grad():
            torch.compile(method, fullgraph=True, dynamic=False, backend=record,
                          options=compat.guard_recording_options(recording, method.__func__.__globals__))(*args)
    finally:
        compat.forget_dynamo_cache(code)
    return guards.from_dynamo(recording, method)


@pytest.fixture(scope="module")
def model_and_guards():
    torch.manual_seed(0)
    model = Model()
    return model, capture_guards(model.forward, torch.randn(2, 8))


def scope_of(model) -> guards.Scope:
    return guards.Scope(model, Model.forward.__globals__)


def texts(gs: guards.GuardSet, kind: str) -> set[str]:
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
    again = guards.GuardSet.from_json(json.loads(text))
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
    first = guards.variant_key("k" * 40, gs, scope)
    assert guards.variant_key("k" * 40, gs, scope) == first
    model.heads = 8
    try:
        assert guards.variant_key("k" * 40, gs, scope) != first
    finally:
        model.heads = 4


def test_choose_takes_the_record_whose_guards_hold(model_and_guards):
    model, gs = model_and_guards
    scope = scope_of(model)
    records = {"e0": {"guards": gs.to_json(), "name": "first"}}
    found = guards.choose(records.get, "e0", scope)
    assert found.record["name"] == "first" and found.key == "e0" and found.mismatch is None
    model.heads = 8
    try:
        miss = guards.choose(records.get, "e0", scope)
        assert miss.record is None and miss.key != "e0" and "self.heads" in str(miss.mismatch)
        records[miss.key] = {"guards": capture_guards(model.forward, torch.randn(2, 8)).to_json(), "name": "8"}
        assert guards.choose(records.get, "e0", scope).record["name"] == "8"
    finally:
        model.heads = 4
    assert guards.choose(records.get, "e0", scope).record["name"] == "first"


def test_fingerprints_are_stable_names_not_addresses():
    assert guards.identity_fp(torch.nn.functional.relu)[:2] == ["function", "torch.nn.functional.relu"]
    assert guards.identity_fp(torch.nn.functional.linear) == ["builtin", "torch._C._nn.linear"]
    assert guards.identity_fp(types) == ["module", "types"]
    assert guards.identity_fp(Mode.A) == ["enum", f"{__name__}.Mode", "A"]
    assert guards.value_fp(1e-5) == ["float", "1e-05"] and guards.value_fp(True) == ["bool", True]
    assert guards.value_fp(torch.Size([2, 3])) == ["torch.Size", [["int", 2], ["int", 3]]]
    partial = functools.partial(torch.add, alpha=2)
    assert guards.identity_fp(partial)[0] == "partial"
    with pytest.raises(Unpersistable):
        guards.identity_fp(object())


def test_code_digest_ignores_where_the_code_is_but_not_what_it_does():
    def f(x):
        return x + 1

    def g(x):
        return x + 1

    def h(x):
        return x + 2

    assert guards.code_digest(f.__code__) == guards.code_digest(g.__code__)
    assert guards.code_digest(f.__code__) != guards.code_digest(h.__code__)


def test_an_object_known_only_by_identity_makes_the_guards_local():
    """Dynamo guards some objects by identity alone (ID_MATCH on an instance): no fingerprint means the same in another
    process, so the entry is local (checked by identity in this process, never stored)."""
    holder = torch.nn.Module()
    holder.token = object()
    method = types.MethodType(lambda self, x: x, holder)
    dynamo_guard = compat.DynamoGuard("ID_MATCH", "L['self'].token", True, holder.token, {})
    gs = guards.from_dynamo(compat.GuardRecording([dynamo_guard]), method)
    assert gs.local is not None and "known only by its identity" in gs.local
    with pytest.raises(Unpersistable):
        gs.to_json()
    scope = guards.Scope(holder, {})
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
    assert guards.parse_source(source) == path


@pytest.mark.parametrize("source", ["___tuple_iterator_getitem(G['it'], 0)", "G['x'][G['i']]", "L['a'] + 1"])
def test_other_source_forms_are_refused_not_guessed(source):
    with pytest.raises(Unpersistable):
        guards.parse_source(source)


def test_a_guard_on_a_torch_module_this_process_has_not_imported_holds_without_importing_it():
    """Dynamo's traces import helpers of torch's own (torch._dynamo.polyfills); a warm process never imports them:
    their guards hold without a check (the torch version is a key factor), and checking them imports nothing."""
    name = "torch._gearcache_never_imported"
    guard = guards.ValueGuard("value", (("module", name), ("attr", "flag")), None, ["bool", True])
    scope = guards.Scope(torch.nn.Linear(1, 1), {})
    assert guards.unloaded_torch_module(guard)
    assert guards.GuardSet([guard]).mismatch(scope) is None
    assert guards.GuardSet([guard]).live_fingerprints(scope) == [["bool", True]]
    assert name not in sys.modules
    other = guards.ValueGuard("value", (("module", "json"), ("attr", "flag")), None, ["bool", True])
    assert not guards.unloaded_torch_module(other), "only torch's own modules"


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
    assert guards.step(obj, ("generic_attr", "size")) == 3
    assert guards.path_text((("global", "cfg"), ("generic_attr", "size"))) == "cfg.size"
