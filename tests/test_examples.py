"""Run the Hugging Face examples end to end (cold start, then warm start, each in a fresh process).

Slow: every cold start compiles. The arguments keep each example to two compiled entries. Needs transformers
(the "examples" extra, which .ci/run installs): without it these fail rather than skip."""
import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(proc.stdout)
    return summary


def test_hf_llama(tmp_path):
    # batch 3 (padded to gear 4), prompt 5 (padded to 8): one prefill and one decode entry
    s = run_example("hf_llama.py", "--cache-dir", str(tmp_path / "store"), "--gears", "4", "--batch", "3",
                    "--prompt-len", "5", "--new-tokens", "4")
    assert s["example"] == "hf_llama" and s["ok"] is True
    assert s["tokens_match_eager"] is True
    assert s["cold"]["compiles"] == 2 and s["cold"]["loads"] == 0
    assert s["warm"]["compiles"] == 0 and s["warm"]["traces"] == 0 and s["warm"]["loads"] == 2


def test_hf_vit(tmp_path):
    # gears 2 and 4; batches 1..4, so 1 and 3 are padded
    s = run_example("hf_vit.py", "--cache-dir", str(tmp_path / "store"), "--gears", "2,4")
    assert s["example"] == "hf_vit" and s["ok"] is True
    assert s["predictions_match_eager"] is True
    assert s["cold"]["compiles"] == 2
    assert s["warm"]["compiles"] == 0 and s["warm"]["traces"] == 0 and s["warm"]["loads"] == 2


def test_tp_decoder_toy_on_gloo(tmp_path):
    # 2 ranks, toy size, gear 4 (batch 3 is padded): one prefill and one decode artifact, shared by both ranks
    s = run_example("tp_decoder.py", "--nproc", "2", "--toy", "--device", "cpu", "--gears", "4", "--batch", "3",
                    "--new-tokens", "2", "--cache-dir", str(tmp_path / "store"))
    assert s["example"] == "tp_decoder" and s["ok"] is True
    assert s["equal_eager"] is True and s["tokens_same_cold_and_warm"] is True
    assert s["cold"]["compiles"] == 2 and s["cold"]["compiles_after_warmup"] == 0
    assert s["warm"]["compiles"] == 0 and s["warm"]["traces"] == 0
    assert s["warm"]["loads"] == 4 and s["warm"]["direct_loads"] == 4, "both ranks load both entries by run plan"
