"""gearcache/store/files.py's ``read_json``: a record's parse runs with the cyclic collector paused (issue #38: a warm
start's manifests made the collector promote ~10^4 objects each and run a full collection of the process), and the
collector's state is the program's again afterwards, whatever happened."""
from __future__ import annotations

import concurrent.futures
import gc
import json

import pytest

from gearcache.store import files


def _manifest_like(guards: int = 3000) -> str:
    """JSON shaped like an entry manifest's guards: many small lists (what the collector tracks)."""
    return json.dumps({"guards": [["value", ["self", ["attr", f"a{i}"]], None, ["int", i]] for i in range(guards)]})


def _collections_during(parse, text: str) -> list[int]:
    """The generation of each collection that ran while ``parse(text)`` ran."""
    seen: list[int] = []

    def count(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(count)
    try:
        parse(text)
    finally:
        gc.callbacks.remove(count)
    return seen


def test_a_record_is_parsed_as_json_loads_parses_it_and_no_collection_runs_meanwhile():
    text = _manifest_like()
    assert gc.isenabled()
    assert files.read_json(text) == json.loads(text)
    assert files.read_json(text.encode()) == json.loads(text)
    assert len(_collections_during(json.loads, text)) > 5, "the parse of such a record makes the collector run"
    paused = _collections_during(files.read_json, text)
    # Back on, the collector may run once for the objects the parse left (of whichever generation its counts reach).
    assert len(paused) <= 1, f"at most one collection, once the collector is back: {paused}"
    assert gc.isenabled()


def test_the_collectors_state_is_the_programs_after_a_parse_that_fails_or_a_program_that_disabled_it():
    with pytest.raises(ValueError):
        files.read_json(b"{not json")
    assert gc.isenabled()
    gc.disable()
    try:
        files.read_json(_manifest_like(10))
        assert not gc.isenabled(), "a collector the program disabled stays disabled"
    finally:
        gc.enable()


def test_parses_in_threads_leave_the_collector_enabled():
    text = _manifest_like(500)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: files.read_json(text), range(32)))
    assert all(r == results[0] for r in results)
    assert gc.isenabled()
