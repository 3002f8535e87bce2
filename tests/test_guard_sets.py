"""gearcache/keys/guard_sets.py's work per pass (issue #38: a warm start's look-ups): equal guard JSON parsed once
and shared (``GuardSet.from_json``), a set checked once per pass of checks (``Reading``), every guard still enforced:
a set that does not hold is refused whatever was parsed or checked before. ``tests/test_guards.py`` tests the guards
themselves."""
from __future__ import annotations

import json
import sys
import types

import torch

from gearcache.counters import counters
from gearcache.keys import guard_paths, guard_sets, value_guard


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = 4
        self.eps = 1e-5


def _guards(heads: int = 4) -> list:
    """The JSON of a guard set on ``self.heads`` and ``self.eps`` (as a manifest stores it)."""
    return [["value", ["self", ["attr", "heads"]], None, ["int", heads]],
            ["value", ["self", ["attr", "eps"]], None, ["float", repr(1e-5)]]]


def _scope(model: torch.nn.Module) -> guard_paths.Scope:
    return guard_paths.Scope(model, {})


def test_equal_guard_json_is_parsed_once_and_the_set_is_shared():
    """The gears of one method store the same guards: a second manifest's equal JSON gives the set already parsed
    (a fresh ``json.loads`` each time, as each manifest is read); JSON differing in one expected value is a set of
    its own, checked on its own values."""
    model = Holder()
    scope = _scope(model)
    text = json.dumps(_guards())
    before = counters.guard_parses
    first = guard_sets.GuardSet.from_json(json.loads(text))
    assert first.mismatch(scope) is None, "the JSON's fingerprints are those of a live Holder"
    for _ in range(3):
        assert guard_sets.GuardSet.from_json(json.loads(text)) is first
    assert counters.guard_parses == before + 1
    other = guard_sets.GuardSet.from_json(_guards(heads=8))
    assert other is not first and counters.guard_parses == before + 2
    mismatch = other.mismatch(scope)
    assert mismatch is not None and mismatch.guard.text() == "self.heads" and "now 4" in str(mismatch)


def test_a_set_checked_in_a_pass_is_answered_from_it_and_a_new_pass_checks_again():
    """One pass of checks (a warm-up's look-ups under the method's lock) checks a set once, whatever the number of
    gears sharing it (``counters.guard_checks``), with what it found: a mismatch stays a mismatch. The next pass reads
    the live values again: a value changed between passes is seen."""
    model = Holder()
    scope = _scope(model)
    gs = guard_sets.GuardSet.from_json(_guards())
    reading = guard_sets.Reading()
    before = counters.guard_checks
    for _ in range(4):
        assert gs.mismatch(scope, reading) is None
    assert counters.guard_checks == before + 1
    model.heads = 2
    later = guard_sets.Reading()
    found = gs.mismatch(scope, later)
    assert found is not None and found.guard.text() == "self.heads"
    assert gs.mismatch(scope, later) is found and counters.guard_checks == before + 2
    assert gs.mismatch(scope) is not None, "without a pass, every check reads the live values"


def test_a_guard_skipped_in_a_pass_is_checked_once_its_torch_module_is_imported():
    """A guard on a torch module this process has not imported holds unchecked (``unloaded_torch_module``); if a load
    later in the pass imports it, the set's next check in that pass checks the guard: a pass never answers from a
    skip that no longer applies."""
    name = "torch._gearcache_test_imported_mid_pass"
    flag = value_guard.ValueGuard("value", (("module", name), ("attr", "flag")), None, ["bool", True])
    gs = guard_sets.GuardSet([flag])
    scope = _scope(Holder())
    reading = guard_sets.Reading()
    assert gs.mismatch(scope, reading) is None
    module = types.ModuleType(name)
    module.flag = False                             # type: ignore[attr-defined]
    sys.modules[name] = module
    try:
        found = gs.mismatch(scope, reading)
        assert found is not None and found.guard is flag
        module.flag = True                          # type: ignore[attr-defined]
        assert gs.mismatch(scope, guard_sets.Reading()) is None
    finally:
        del sys.modules[name]


def test_a_value_a_pass_reads_once_is_read_once():
    reading = guard_sets.Reading()
    model = Holder()
    reads = []
    for _ in range(3):
        assert reading.once(("heads", id(model)), lambda: reads.append(1) or model.heads) == 4
    assert reads == [1]
    assert guard_sets.Reading().once(("heads", id(model)), lambda: 5) == 5, "each pass reads it anew"
