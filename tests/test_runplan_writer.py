"""The run plan's writer (gearcache/runplan/writer.py): plans written at compile time, covered by the artifact's
digests, and refused (torch's loader instead) for graphs a plan cannot run exactly like torch."""
import json
import pathlib
import shutil

import pytest
import torch

import gearcache
from conftest import run_script
from gearcache import CacheCorruptionError, runplan
from gearcache.store import Store


def _plans(cache: pathlib.Path) -> dict[str, dict]:
    return {p.parent.parent.name: json.loads(p.read_text()) for p in cache.glob("artifacts/*/runplan/plan.json")}


def test_every_tiny_lm_artifact_has_a_supported_plan(tiny_lm_cache):
    cache, _ = tiny_lm_cache
    plans = _plans(cache)
    assert len(plans) == 2                                  # prefill and decode
    for akey, plan in plans.items():
        assert plan["supported"], plan.get("reason")
        assert plan["format"] == runplan.FORMAT and plan["num_outputs"] >= 1
        wrapper = cache / "artifacts" / akey / "runplan" / plan["wrapper"]
        assert "def call(" in wrapper.read_text()
        for lib in plan["cpp"].values():                    # C++ kernels: libraries inside the artifact
            assert (cache / "artifacts" / akey / lib).is_file()
        if plan["device_type"] == "cuda":
            for spec in plan["triton"].values():
                assert (cache / "artifacts" / akey / spec["cubin"]).is_file()


def test_plan_files_are_covered_by_the_artifact_digests(tiny_lm_cache, tmp_path):
    cache, _ = tiny_lm_cache
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, ignore=shutil.ignore_patterns("locks", "index", "leases"))
    akey = next(iter(_plans(copy)))
    store = Store(copy)
    store.artifacts.verify(akey)
    wrapper = copy / "artifacts" / akey / "runplan" / "wrapper.py"
    wrapper.chmod(0o600)
    wrapper.write_text(wrapper.read_text() + "\nimport os  # tampered\n")
    with pytest.raises(CacheCorruptionError, match="runplan/wrapper.py"):
        store.artifacts.verify(akey)


@pytest.mark.slow
def test_graph_returning_a_view_of_its_input_falls_back_to_torchs_loader(tmp_path, empty_torch_caches):
    """An output aliasing an input needs torch's AOTAutograd wrapper: no plan, torch's loader, same answers."""
    cache = tmp_path / "cache"
    cold = run_script("run_alias.py", str(cache))
    assert cold["equal"] and cold["counters"]["compiles"] == 1
    (plan,) = _plans(cache).values()
    assert plan["supported"] is False and "alias" in plan["reason"]
    warm = run_script("run_alias.py", str(cache), env=empty_torch_caches)
    assert warm["equal"] and warm["aliases_input"]
    assert warm["counters"]["loads"] == 1 and warm["counters"]["direct_loads"] == 0
    assert warm["counters"]["compiles"] == 0


class _WritesAndAliases(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.run = gearcache.cache_compile(self._forward, cache_dir=cache_dir)

    def _forward(self, x):
        x.mul_(2)                               # written in place
        return self.lin(x), x[:, :2]            # and a view of it returned: no run plan


def test_a_plan_refused_still_names_the_inputs_its_graph_writes(tmp_path):
    """An artifact without a run plan (an output aliases an input) loads through torch's loader; its plan.json still
    lists the graph inputs it writes in place, and the loaded entry carries it (CUDA graphs copy such an input back
    after each replay instead of refusing it), equal to eager."""
    m = _WritesAndAliases(str(tmp_path))
    x = torch.randn(3, 4)
    x_eager = x.clone()
    with torch.no_grad():
        out, view = m.run(x)
        ref, ref_view = m._forward(x_eager)
    assert torch.allclose(out, ref) and torch.equal(x, x_eager) and torch.equal(view, ref_view)
    (plan,) = _plans(tmp_path).values()
    assert plan["supported"] is False and "alias" in plan["reason"]
    (entry,) = m.run.life.table.values()
    leaf_inputs = [j for j, (kind, ref) in enumerate(entry.manifest["inputs"]) if kind == "leaf" and int(ref) == 0]
    assert plan["mutated_inputs"] == leaf_inputs and entry.compiled.plan["mutated_inputs"] == leaf_inputs
