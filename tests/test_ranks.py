"""Ranks: per-topology entries, one shared folder, each distinct graph compiled once across processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ahead

SCRIPTS = Path(__file__).parent / "scripts"


def _torchrun(nproc: int, cache: Path, out: Path, *flags: str, script: str = "run_tp.py", ok: bool = True,
              timeout: float = 600, **env: str) -> list[dict]:
    """Run ``tests/scripts/<script>`` on ``nproc`` ranks (torchrun, gloo), bounded by ``timeout`` (a hang fails the
    test); the ranks' reports (``out/rank{r}.json``, those written). ``ok``: the job must succeed."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(SCRIPTS / script), str(cache), str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    if ok:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc) if (out / f"rank{r}.json").exists()]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_cold_then_warm_start_with_collectives_inside(tmp_path, nproc):
    cache = tmp_path / "cache"
    cold = _torchrun(nproc, cache, tmp_path / "cold")
    assert all(r["equal"] for r in cold), "outputs equal eager (all_reduce over the live gloo group) on every rank"
    assert sum(r["counters"]["compiles"] for r in cold) == 1, "the shared graph is compiled once across ranks"
    assert sum(r["counters"]["traces"] for r in cold) == nproc, "each rank may trace to find the shared artifact"
    assert [r["topology"] for r in cold] == [f"world{nproc}_rank{r}_tp{r}_pp0" for r in range(nproc)]
    for r in cold:                                  # each rank has its own manifest folder
        assert any((cache / "entries" / r["topology"]).rglob("*.json"))
    assert len(list((cache / "artifacts").iterdir())) == 1
    plan = _plans(cache)[0]
    assert plan["supported"], plan.get("reason")
    assert plan["groups"] == {"0": {"ranks": list(range(nproc)), "backend": "gloo"}}
    assert {"all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "wait_tensor"} <= \
        {op for ns, op in plan["ops"] if ns == "_c10d_functional"}
    warm = _torchrun(nproc, cache, tmp_path / "warm")
    assert all(r["equal"] for r in warm)
    assert all(r["counters"]["compiles"] == 0 and r["counters"]["traces"] == 0 for r in warm)
    assert all(r["counters"]["loads"] == 1 and r["counters"]["direct_loads"] == 1 for r in warm), "through the plan"
    assert all(r["imported_before_eager"] == [] for r in warm), "a warm rank imports neither Dynamo nor Inductor"
    # CUDA graphs of a job with process groups are warmed up and recorded in one thread, in one order on every rank:
    # warm-up threads would send the graphs' collectives to the group in a different order per rank (a hang on 2 GPUs)
    assert all(r["captures_in_one_thread"] for r in warm)
    if nproc == 2:
        _other_groups_never_load(cache, tmp_path)


def _plans(cache: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((cache / "artifacts").glob("*/runplan/plan.json"))]


def _other_groups_never_load(cache: Path, tmp_path: Path) -> None:
    """A job whose process groups differ compiles its own artifact; the loader refuses a plan of another group."""
    folder = next((cache / "artifacts").iterdir())
    other = _torchrun(2, cache, tmp_path / "other", GEARCACHE_TEST_EXTRA_GROUP="1")
    assert all(r["equal"] for r in other)
    assert all(folder.name not in r["akeys"] for r in other), "the first job's artifact is never loaded"
    assert sum(r["counters"]["compiles"] for r in other) == 1
    assert all(r["counters"]["compiles"] + r["counters"]["loads"] == 1 for r in other), "the other rank loads it"
    assert len(_plans(cache)) == 2 and all(p["supported"] for p in _plans(cache))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "load_other_group.py"), str(folder),
                           str(tmp_path / "pg_store")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert errors["no_group"].startswith("ProcessGroupMismatchError") and "no initialised" in errors["no_group"]
    assert errors["one_rank_group"].startswith("ProcessGroupMismatchError")
    assert "'0'" in errors["one_rank_group"] and "[0, 1]" in errors["one_rank_group"]


@pytest.mark.slow
def test_ranks_with_another_shard_shape_get_their_own_artifact(tmp_path):
    """Four ranks, the last with a narrower shard: two distinct graphs, each compiled once across the node."""
    cache = tmp_path / "cache"
    cold = _torchrun(4, cache, tmp_path / "cold", "--uneven")
    assert all(r["equal"] for r in cold)
    assert sum(r["counters"]["compiles"] for r in cold) == 2, [r["counters"] for r in cold]
    assert cold[3]["counters"]["compiles"] == 1, "the odd shard's graph is its own, compiled by its rank"
    entries = {r["topology"]: json.loads(next((cache / "entries" / r["topology"]).rglob("*.json")).read_text())
               for r in cold}
    akeys = [entries[r["topology"]]["akey"] for r in cold]
    assert akeys[0] == akeys[1] == akeys[2] != akeys[3]
    assert sorted(p.name for p in (cache / "artifacts").iterdir()) == sorted(set(akeys))
    warm = _torchrun(4, cache, tmp_path / "warm", "--uneven")
    assert all(r["equal"] for r in warm)
    assert all(r["counters"]["compiles"] == 0 and r["counters"]["loads"] == 1 for r in warm)


def _spawned(tmp_path: Path, *mode: str, script: str = "run_spawned_ranks.py") -> list[dict]:
    """A job of ``tests/scripts/<script>`` (2 ranks by mp.spawn, gloo) on ``tmp_path/cache``: the ranks' reports."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), str(tmp_path / "cache"), str(out), port, *mode],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_a_given_global_rank_that_disagrees_with_the_group_is_refused(tmp_path):
    """``global_rank=int(os.environ.get("RANK", 0))`` in a job started by mp.spawn (no RANK): both ranks passed 0,
    filed their entries under world2_rank0, and a warm job served rank 1 rank 0's graph (its ``dist.get_rank()``
    folded to 0: output off by one). Now the rank whose given rank disagrees with the group's is refused at its
    first call, naming the argument, the group's rank and the fix; rank 0 (whose given rank agrees) is served."""
    for _ in range(2):                                  # cold, then warm on the same folder
        ranks = _spawned(tmp_path, "given-env-rank")
        assert ranks[0]["error"] is None and ranks[0]["equal"], ranks[0]
        assert ranks[0]["folder"] == "world2_rank0_tp0_pp0"
        error = ranks[1]["error"]
        assert error is not None and error["type"] == "ConfigError", ranks[1]
        assert "global_rank=0: this process is rank 1 of 2" in error["message"]
        assert "global_rank=dist.get_rank()" in error["message"]
        assert ranks[1]["compiles"] == ranks[1]["loads"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("env", ["", "torchrun-env"], ids=["spawn", "torchrun-env"])
def test_entries_served_before_the_process_group_are_not_served_after_it(tmp_path, env):
    """Each rank calls the method once before init_process_group (a smoke test; ``dist.get_rank() if
    dist.is_initialized() else 0`` folds to 0), then after it: the entry in the method's table was served again, and
    rank 1 got rank 0's answer (off by one), in the cold job and in a warm one; with torchrun's RANK set, the entry
    was filed under the rank's own folder, only its process groups ([] then) differ. The default group's slot is
    watched with the entries' value guards: once it changes, entries filed under another rank folder or other
    process groups are dropped, and the next call looks up the rank's own entry."""
    for _ in range(2):                                  # cold, then warm on the same folder
        ranks = _spawned(tmp_path, "smoke-before-group", env)
        assert all(r["smoke_equal"] for r in ranks), ranks
        assert all(r["error"] is None and r["equal"] for r in ranks), ranks
        assert [r["folder"] for r in ranks] == ["world2_rank0_tp0_pp0", "world2_rank1_tp0_pp0"]


@pytest.mark.slow
def test_a_gear_plan_proved_before_the_process_group_is_not_served_after_it(tmp_path):
    """A geared method whose graph gains an all_to_all_single of the padded batch once ``dist.is_initialized()``
    (folded by Dynamo, unguarded): its gear plan, proved on the graph traced before init_process_group, was served
    after it, in that job (the plan kept in memory) and in a later job that never called before the group (the plan
    stored under the same key): rows of the padding crossed ranks (a wrong answer on both ranks). Now the plan's key
    holds the process groups and a plan made before the group is dropped once it exists: the call is refused, naming
    the op, as in a job that never called before the group."""
    smoke = _spawned(tmp_path, "smoke", script="run_spawned_gear_plan.py")
    warm = _spawned(tmp_path, script="run_spawned_gear_plan.py")
    assert all(r["smoke_equal"] for r in smoke), smoke
    for r in smoke + warm:
        assert r["outcome"] == "refused", r
        assert "_c10d_functional.all_to_all_single" in r["error"] and "padded dim 0" in r["error"], r["error"]


@pytest.mark.slow
def test_a_process_that_joins_another_group_as_another_rank_is_served_that_rank(tmp_path):
    """Two processes, two process groups in turn (destroy_process_group, then init_process_group with the ranks
    swapped): each process's second group was served the entry of its first rank from the method's table (both
    outputs wrong). The default group's slot is watched: the entries of the other rank are dropped, and the second
    group's call looks up its own rank's folder."""
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPTS / "run_regrouped_ranks.py"), str(tmp_path / "cache"), str(out),
                           *ports], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for p in range(2):
        report = json.loads((out / f"proc{p}.json").read_text())
        assert [r["rank"] for r in report] == [p, 1 - p]
        assert [r["folder"] for r in report] == [f"world2_rank{p}_tp0_pp0", f"world2_rank{1 - p}_tp0_pp0"]
        assert all(r["equal"] for r in report), report


@pytest.mark.slow
def test_ranks_built_before_the_process_group_keep_their_own_entries(tmp_path):
    """Ranks started by mp.spawn (no RANK in the environment) that build the model before init_process_group: each
    rank's entries go to its own folder, read from the group at the first call. Rank 1 was served rank 0's graph
    (its ``dist.get_rank()`` folded to 0: output off by one) when the folder was fixed at construction."""
    reports = _spawned(tmp_path)
    assert [r["folder"] for r in reports] == ["world2_rank0_tp0_pp0", "world2_rank1_tp0_pp0"]
    assert all(r["equal"] for r in reports), reports
    assert [r["compiles"] for r in reports] == [1, 1], "each rank's graph is its own (the rank is a constant in it)"


@pytest.mark.slow
def test_eight_processes_racing_on_one_empty_folder(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "race_compile.py"), str(cache)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(8)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["equal"] for r in reports)
    assert sum(r["compiles"] for r in reports) == 1, "one process compiles, the others wait and load"
    assert all(r["compiles"] + r["loads"] == 1 for r in reports), "each process counts its compile or its load"
    artifacts = list((cache / "artifacts").iterdir())
    assert len(artifacts) == 1 and (artifacts[0] / "MANIFEST.json").is_file()
    assert not any((cache / "tmp").iterdir()), "no temp folders left"
    assert not list(cache.rglob("*.tmp")), "no temp files left"


# ----------------------------------------------------------------- geared warm-up on 4 and 8 ranks
# (gearcache/ranks/phases.py)
GEARS = [1, 2, 4]


@pytest.fixture(scope="session", params=[2, pytest.param(4, marks=pytest.mark.slow),
                                         pytest.param(8, marks=pytest.mark.slow)], ids=["2", "4", "8"])
def tp_gears(request, tmp_path_factory, ahead_jobs) -> tuple[int, Path, list[dict]]:
    """A cold job of tests/scripts/run_tp_gears.py (a TP MLP with an all-reduce inside, gears 1, 2, 4) on 2, 4 and 8
    ranks (2 in the fast tier, on the 2-core machine): ``(nproc, its cache folder, the ranks' reports)``."""
    nproc = request.param
    if nproc == 2:
        return ahead_jobs.value("tp_gears_2")
    return _tp_gears_cold(tmp_path_factory, nproc)


def _tp_gears_cold(tmp_path_factory, nproc: int) -> tuple[int, Path, list[dict]]:
    root = tmp_path_factory.mktemp(f"tp_gears_{nproc}")
    return nproc, root / "cache", _torchrun(nproc, root / "cache", root / "cold", script="run_tp_gears.py")


@ahead("tp_gears_2", used_by=lambda item: getattr(item, "callspec", None) is not None
       and item.callspec.params.get("tp_gears") == 2)
def _tp_gears_2(tmp_path_factory, need) -> tuple[int, Path, list[dict]]:
    return _tp_gears_cold(tmp_path_factory, 2)


def test_geared_tp_warmup_cold_then_warm_never_hangs(tp_gears, tmp_path):
    """Cold: ranks compile different gears at once (rank order), then every rank passes the fence and runs the gears
    in one order; the sweep equals eager; each distinct graph compiled once over all ranks; the teardown returns.
    Warm (a fresh job): loads only, through run plans, no compiler imported."""
    nproc, cache, cold = tp_gears
    assert all(r["error"] is None and r["equal"] for r in cold), [r["error"] for r in cold]
    assert sum(r["counters"]["compiles"] for r in cold) == len(GEARS), [r["counters"]["compiles"] for r in cold]
    assert all(r["counters"]["traces"] == 1 + len(GEARS) for r in cold), "the gear plan's trace, then each gear"
    assert all(r["counters_after_warmup"]["rank_fences"] == 1 for r in cold), "one fence before the warm-up's runs"
    assert all(r["destroy_returned"] and r["gearcache_threads"] == [] for r in cold)
    assert len(list((cache / "artifacts").iterdir())) == len(GEARS)
    groups = {"0": {"ranks": list(range(nproc)), "backend": "gloo"}}
    manifests = [json.loads(p.read_text()) for p in (cache / "entries").rglob("*.json") if "plans" not in p.parts]
    assert len(manifests) == nproc * len(GEARS) and all(m["groups"] == groups for m in manifests)
    warm = _torchrun(nproc, cache, tmp_path / "warm", script="run_tp_gears.py")
    assert all(r["error"] is None and r["equal"] for r in warm)
    assert all(r["counters"]["compiles"] == 0 and r["counters"]["traces"] == 0 for r in warm)
    assert all(r["counters"]["loads"] == r["counters"]["direct_loads"] == len(GEARS) for r in warm)
    assert all(r["imported_before_sweep"] == [] for r in warm), "a warm rank imports neither Dynamo nor Inductor"
    assert all(r["counters_after_warmup"]["rank_fences"] == 1 for r in warm)
    assert all(r["destroy_returned"] and r["destroy_s"] < 10 and r["gearcache_threads"] == [] for r in warm)


@pytest.mark.slow
def test_ranks_about_to_run_other_gears_raise_instead_of_hanging(tp_gears, tmp_path):
    """The last rank warms up gears 1, 2 where the others warm up 1, 2, 4: its collectives would pair with theirs
    wrongly (before the fence: gloo aborted on the size mismatch, NCCL would hang or mix data). Every rank raises
    RankDivergenceError naming each rank's gears, before any rank runs a collective."""
    nproc, cache, _ = tp_gears
    reports = _torchrun(nproc, cache, tmp_path / "div", script="run_tp_gears.py", ok=False, timeout=300,
                        **{f"GEARS_RANK_{nproc - 1}": "1,2", "RANK_TIMEOUT_S": "120"})
    assert len(reports) == nproc and all(r["error"]["type"] == "RankDivergenceError" for r in reports)
    for r in reports:
        assert f"rank {nproc - 1}: run_tp_gears.TPMlp.fwd warm-up runs: gears [[1], [2]]" in r["error"]["message"]
        assert "rank 0: run_tp_gears.TPMlp.fwd warm-up runs: gears [[1], [2], [4]]" in r["error"]["message"]
        assert r["counters_after_warmup"]["rank_fences"] == 0


@pytest.mark.slow
def test_a_rank_that_never_arrives_is_named_after_the_timeout(tp_gears, tmp_path):
    """Rank 1 never reaches its warm-up: the others wait at the fence for rank_timeout_s (5 s here; before the fence
    they waited in the first gear's all-reduce, gloo's 30 minutes), then raise RankWaitError naming rank 1 and what
    it last reported."""
    nproc, cache, _ = tp_gears
    reports = _torchrun(nproc, cache, tmp_path / "stall", script="run_tp_gears.py", ok=False, timeout=300,
                        STALL_RANK="1", RANK_TIMEOUT_S="5")
    assert sorted(r["rank"] for r in reports) == [r for r in range(nproc) if r != 1]
    for r in reports:
        assert r["error"]["type"] == "RankWaitError"
        assert f"rank {r['rank']} waited" in r["error"]["message"] and "for rank(s) [1]" in r["error"]["message"]
        assert "rank 1: nothing reported" in r["error"]["message"]


# ------------------------------------------------------------------- pipeline stages (examples/pp_decoder.py), 4 ranks
EXAMPLES = Path(__file__).parent.parent / "examples"


def _pp_job(cache: Path, timeout: float = 900) -> list[dict]:
    """One start of examples/pp_decoder.py (2 stages x TP 2, tiny sizes, gloo): the ranks' reports."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(EXAMPLES / "pp_decoder.py"), "--child", "--toy", "--device", "cpu", "--cache-dir", str(cache),
           "--gears", "1,2", "--batch", "2", "--prompt-len", "4", "--new-tokens", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["ranks"]


@pytest.mark.slow
def test_pipeline_stages_cold_then_warm_tokens_equal_the_unsplit_model(tmp_path):
    """2 pipeline stages x TP 2: each stage's prefill and decode cached under its pp_rank in one folder, activations
    sent between stages; the tokens equal the unsplit eager model's in the cold job and in a fresh warm one, which
    compiles nothing. Each stage's ranks share its artifacts; the stages' graphs differ."""
    cache = tmp_path / "cache"
    cold = _pp_job(cache)
    assert [(r["pp"], r["tp"]) for r in cold] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["topology"] for r in cold] == [f"world4_rank{g}_tp{g % 2}_pp{g // 2}" for g in range(4)]
    assert all(r["tokens_equal_eager"] and r["split_eager_equals_unsplit"] for r in cold), [r["tokens"] for r in cold]
    assert len({json.dumps(r["tokens"]) for r in cold}) == 1, "every rank ends with the same tokens"
    assert all(r["compiles_in_generate"] == 0 for r in cold), "warm-up gave every gear of the generation an entry"
    # per stage: decode and prefill, gears 1 and 2, compiled once for both TP ranks of the stage
    assert sum(r["counters"]["compiles"] for r in cold) == 2 * 2 * 2
    assert all(sum(r["counters"]["compiles"] for r in cold if r["pp"] == pp) == 4 for pp in (0, 1))
    for r in cold:
        folder = cache / "entries" / r["topology"]
        methods = sorted(p.name for p in folder.iterdir())
        assert methods == ["pp_decoder.Stage.decode", "pp_decoder.Stage.prefill"], methods
        manifests = [json.loads(p.read_text()) for p in folder.glob("*/*.json")]
        assert len(manifests) == 4 and all(m["topology"] == r["topology"] for m in manifests)
        tp_group = [2 * r["pp"], 2 * r["pp"] + 1]
        assert all(any(g["ranks"] == tp_group for g in m["groups"].values()) for m in manifests), \
            "each stage's collectives run on its own TP group"
    assert len(list((cache / "artifacts").iterdir())) == 8
    warm = _pp_job(cache)
    assert all(r["tokens_equal_eager"] for r in warm) and [r["tokens"] for r in warm] == [r["tokens"] for r in cold]
    assert all(r["counters"]["compiles"] == 0 and r["counters"]["traces"] == 0 for r in warm)
    assert all(r["counters"]["loads"] == r["counters"]["direct_loads"] == 4 for r in warm)
    assert all(r["counters"]["rank_fences"] == 2 for r in warm), "decode's and prefill's fence, per TP group"


@pytest.mark.slow
def test_padded_decode_gears_through_collectives_are_proved_not_sampled(tmp_path):
    """examples/tp_decoder.py's decode (toy size, bfloat16, 2 ranks on gloo) under default settings, a batch of 3 on
    gear 4: its all_reduces are elementwise across ranks, so the padding analysis proves the gear exact (pad 0 for
    the ids and the KV cache) and it is served equal to the sharded eager model on every rank with no sample run
    against eager (before, a gear was checked once against eager with a tolerance: the H100s' bf16 GEMM noise
    between 3 and 4 rows refused it, 0.0195). Row blocks through all_gather_into_tensor, reduce_scatter_tensor and an
    all_to_all_single along an unpadded dim are served the same way; an all_to_all_single of the padded batch, whose
    rows would cross the ranks' blocks, is refused naming the op (tests/scripts/run_tp_padding.py)."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(SCRIPTS / "run_tp_padding.py"), str(tmp_path / "cache"), str(out), "bfloat16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        for name in ("decode", "gather_rows", "scatter_rows", "exchange_features"):
            case = r[name]
            assert case["outcome"] == "served" and case["equal"], (name, case)
            assert case["mixing"] == [] and case["counters"]["padding_verifications"] == 0, (name, case)
            assert case["counters"]["pads"] == 1, (name, case)
        assert r["decode"]["pad_values"] == {"ids": 0, "kv": 0.0}
        refused = r["exchange_batch"]
        assert refused["outcome"] == "refused" and refused["counters"]["compiles"] == 0
        assert "_c10d_functional.all_to_all_single" in refused["error"] and "dist.all_to_all_single(out, y)" in \
            refused["error"] and "exchanges blocks of a padded dim 0 between ranks" in refused["error"]
