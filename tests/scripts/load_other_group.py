"""Load a run plan compiled for another process group, directly through gearcache's loader (one process, gloo).

usage: python load_other_group.py ARTIFACT_DIR STORE_FILE
Prints one JSON line: the error each attempt raised (before init_process_group, then in a one-rank group).
"""
import gc
import json
import pathlib
import sys

import torch.distributed as dist

from gearcache import runplan


def attempt(folder: pathlib.Path) -> str:
    try:
        runplan.load_artifact(folder)
    except Exception as exc:        # noqa: BLE001 - the test asserts the type and message
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def main() -> None:
    folder, store_file = pathlib.Path(sys.argv[1]), sys.argv[2]
    before = attempt(folder)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
    one_rank = attempt(folder)
    dist.destroy_process_group()
    print(json.dumps({"no_group": before, "one_rank_group": one_rank}))


if __name__ == "__main__":
    main()
    gc.freeze()     # the report is out: exit without the final collection's walk over torch's objects (1-2 s of CPU)
