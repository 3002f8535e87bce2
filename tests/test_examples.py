"""Run the Hugging Face examples end to end (cold start, then warm start, each in a fresh process).

Slow: every cold start compiles. The arguments keep each example to two compiled entries. The three examples are
independent, so the module's first test starts all three at once (each example's starts stay one after the other,
each in a fresh process; on a 2-core machine one example's single-threaded tracing and lowering leave a core to the
others) and each test checks its own. Needs transformers (the "examples" extra, which .ci/run installs): without it
these fail rather than skip."""
from pathlib import Path

import pytest

from conftest import Script

pytestmark = pytest.mark.slow      # the slow tier (pytest -m slow): CI runs it after the README's line

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example_args(tmp: Path) -> dict[str, list[str]]:
    """Each example's script and arguments, with its own store under ``tmp``."""
    return {
        # batch 3 (padded to gear 4), prompt 5 (padded to 8): one prefill and one decode entry
        "hf_llama": ["hf_llama.py", "--cache-dir", str(tmp / "hf_llama" / "store"), "--gears", "4", "--batch", "3",
                     "--prompt-len", "5", "--new-tokens", "4"],
        # gears 2 and 4; batches 1..4, so 1 and 3 are padded
        "hf_vit": ["hf_vit.py", "--cache-dir", str(tmp / "hf_vit" / "store"), "--gears", "2,4"],
        # 2 ranks, toy size, gear 4 (batch 3 is padded): one prefill and one decode artifact, shared by both ranks
        "tp_decoder": ["tp_decoder.py", "--nproc", "2", "--toy", "--device", "cpu", "--gears", "4", "--batch", "3",
                       "--new-tokens", "2", "--cache-dir", str(tmp / "tp_decoder" / "store")],
    }


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """``examples(name)``: the JSON summary of example ``name``; all three are started at once on the first call."""
    tmp = tmp_path_factory.mktemp("examples")
    started: dict[str, Script] = {}

    def run_example(name: str) -> dict:
        if not started:
            for n, (script, *args) in example_args(tmp).items():
                (tmp / n).mkdir()
                started[n] = Script(EXAMPLES / script, *args)
        summary = started[name].result(timeout=1200)
        print(started[name].stdout)
        return summary
    yield run_example
    for script in started.values():
        script.kill()


def test_hf_llama(examples):
    s = examples("hf_llama")
    assert s["example"] == "hf_llama" and s["ok"] is True
    assert s["tokens_match_eager"] is True
    assert s["cold"]["compiles"] == 2 and s["cold"]["loads"] == 0
    assert s["warm"]["compiles"] == 0 and s["warm"]["traces"] == 0 and s["warm"]["loads"] == 2


def test_hf_vit(examples):
    s = examples("hf_vit")
    assert s["example"] == "hf_vit" and s["ok"] is True
    assert s["predictions_match_eager"] is True
    assert s["cold"]["compiles"] == 2
    assert s["warm"]["compiles"] == 0 and s["warm"]["traces"] == 0 and s["warm"]["loads"] == 2


def test_tp_decoder_toy_on_gloo(examples):
    s = examples("tp_decoder")
    assert s["example"] == "tp_decoder" and s["ok"] is True
    assert s["equal_eager"] is True and s["tokens_same_cold_and_warm"] is True
    assert s["cold"]["compiles"] == 2 and s["cold"]["compiles_after_warmup"] == 0
    assert s["warm"]["compiles"] == 0 and s["warm"]["traces"] == 0
    assert s["warm"]["loads"] == 4 and s["warm"]["direct_loads"] == 4, "both ranks load both entries by run plan"


def test_demo_starts_with_empty_torch_caches_of_its_own(tmp_path):
    """examples/demo.py gives each start fresh, empty Inductor and Triton cache folders (never the user's), so its
    cold start is cold on every run; its warm start loads from gearcache's store alone."""
    import json
    import os
    import subprocess
    import sys

    user = {name: tmp_path / name.lower() for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    for folder in user.values():
        folder.mkdir()
        (folder / "left-by-an-earlier-run").write_text("")
    env = {**os.environ, "GEARCACHE_HOME": str(tmp_path / "store"), **{k: str(v) for k, v in user.items()}}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "demo.py"), "--small", "--json"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    cold, warm = summary["cold"], summary["warm"]
    assert cold["compiles"] == 2 and cold["loads"] == 0
    assert warm["compiles"] == 0 and warm["traces"] == 0 and warm["loads"] == 2
    for start in (cold, warm):
        caches = start["torch_caches"]
        assert caches["empty_at_start"], caches
        for name, mine in user.items():
            assert caches[name] and not caches[name].startswith(str(mine)) and not os.path.exists(caches[name])
    assert cold["torch_caches"]["TORCHINDUCTOR_CACHE_DIR"] != warm["torch_caches"]["TORCHINDUCTOR_CACHE_DIR"]
    assert all(os.listdir(folder) == ["left-by-an-earlier-run"] for folder in user.values())
