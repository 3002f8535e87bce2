"""One rank of a job whose ranks share a cache folder: warm up two gears (serial path), report which it compiled.

usage: run_rank_warmup.py CACHE_DIR BARRIER_DIR   (RANK and WORLD_SIZE from the environment)
Every rank waits at a file barrier in BARRIER_DIR before warming up, so they start together. JSON report on the last
line: the gears whose entry this rank compiled (its manifest's compile_seconds > 0) and its counters.
"""
import gc
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from gearcache import CompilerConfig, counters
from gear_models import PairMLP

cache, barrier = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
config = CompilerConfig()
config.inference_config.dim_gears = {"x": {0: [2, 4]}, "y": {0: [2, 4]}}
config.inference_config.warmup_workers = 1
torch.manual_seed(0)
model = PairMLP(str(cache), config).eval()
barrier.mkdir(parents=True, exist_ok=True)
(barrier / f"rank{rank}").touch()
deadline = time.monotonic() + 300
while len(list(barrier.iterdir())) < world:
    assert time.monotonic() < deadline, "the other ranks never reached the barrier"
    time.sleep(0.05)
with torch.inference_mode():
    gears = model.cached.warmup(torch.zeros(4, 4), torch.zeros(4, 4))
compiled = []
for path in (cache / "entries" / model.cached.topology.folder).rglob("*.json"):
    manifest = json.loads(path.read_text())
    if manifest.get("compile_seconds", 0) > 0:
        compiled.append(manifest["signature"]["leaves"][0]["shape"][0])
print(json.dumps({"gears": gears, "compiled": sorted(compiled), "counters": dict(vars(counters))}))
gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
