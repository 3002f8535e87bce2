"""Shared fixtures. Compiling on CPU costs seconds per graph, so compiled artifacts are built once per session."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

# CPU compiles build their C++ kernels against a precompiled header in the tests (torch.compile's own setting;
# gearcache's default is off: docs/CONFIG.md, GEARCACHE_CPP_PCH): g++ otherwise parses ATen's vector headers again
# for every kernel, and the fast tier took twice as long (2026-11-28: 293 s against ~590 s, same load). Scripts
# inherit it. The default is what TinyLM's cold and warm processes run (tiny_lm_cache, tiny_lm_warm: "0"), so the
# product's own compile and warm load stay covered.
os.environ.setdefault("GEARCACHE_CPP_PCH", "1")
DEFAULT_PCH = {"GEARCACHE_CPP_PCH": "0"}


class Script:
    """A Python script running in a fresh process, started at once; :meth:`result` waits for it. ``script``: a name
    under ``tests/scripts/``, or a path (the examples).

    Independent scripts are started together where a test needs several: a compiling process traces and lowers on
    one thread, so on a 2-core machine a second process uses the core the first leaves idle."""

    def __init__(self, script: str | Path, *args: str, env: dict | None = None):
        self.script = str(script)
        path = script if isinstance(script, Path) else TESTS / "scripts" / script
        self.proc = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self._report: dict | None = None
        self.stdout = ""

    def result(self, timeout: float = 300) -> dict:
        """The JSON report on the script's last stdout line (AssertionError if it failed; killed after ``timeout``)."""
        if self._report is None:
            try:
                stdout, stderr = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
            if self.proc.returncode != 0:
                raise AssertionError(f"{self.script} failed ({self.proc.returncode}):\n{stdout[-3000:]}\n"
                                     f"{stderr[-3000:]}")
            self.stdout = stdout
            self._report = json.loads(stdout.strip().splitlines()[-1])
        return self._report

    def kill(self) -> None:
        """Stop the script if it still runs (a fixture's teardown, or a timeout)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def run_script(script: str, *args: str, env: dict | None = None, timeout: float = 300) -> dict:
    """Run ``tests/scripts/<script>`` in a fresh Python process; return the JSON report on its last stdout line."""
    return Script(script, *args, env=env).result(timeout)


def empty_caches_env(folder: Path) -> dict:
    """Environment pointing Inductor's and Triton's caches at (empty) folders under ``folder``."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"), "TRITON_CACHE_DIR": str(folder / "triton")}


class _Ahead:
    """One fixture's value, computed once: by the session's background thread (:func:`ahead_jobs`) or, if that has
    not started it yet, by the fixture that asks (:meth:`value`); either way by the same function."""

    def __init__(self, compute: Callable[[], Any]):
        self.compute = compute
        self.lock = threading.Lock()
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.times: dict[str, Any] = {"waited_s": 0.0}     # when it ran, by which thread, how long tests waited

    def run(self) -> None:
        with self.lock:                 # the other thread waits here while one computes it
            if not self.done:
                self.times.update(start=time.monotonic(), thread=threading.current_thread().name)
                try:
                    self.result = self.compute()
                except BaseException as e:  # noqa: B036 (handed to the fixture that asks, raised there)
                    self.error = e
                self.times["end"] = time.monotonic()
                self.done = True

    def value(self) -> Any:
        asked = time.monotonic()
        self.run()
        self.times["waited_s"] += time.monotonic() - asked
        if self.error is not None:
            raise self.error
        return self.result


Need = Callable[[str], Any]
AHEAD: dict[str, tuple[Callable[[pytest.TempPathFactory, Need], Any], Callable[[pytest.Item], bool]]] = {}


def ahead(name: str, used_by: Callable[[pytest.Item], bool] | None = None):
    """Register ``fn(tmp_path_factory, need)``, the body of a session or module fixture ``name`` that runs scripts in
    fresh processes (``need(other)``: another registered fixture's value), to be computed ahead, in the background,
    when the session collected a test that uses fixture ``name`` (``used_by(item)`` decides instead, e.g. for one
    parameter). The fixture returns ``ahead_jobs.value(name)``.

    The test process compiles and runs on one thread at a time (Inductor's g++ builds aside), so on a 2-core machine
    these scripts take the core it leaves idle; the value is the same whoever computes it."""
    def register(fn):
        AHEAD[name] = (fn, used_by or (lambda item: name in item.fixturenames))
        return fn
    return register


class AheadJobs:
    """The registered fixtures' values of one session (:func:`ahead_jobs`)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, names: list[str]):
        self.factory = tmp_path_factory
        self.jobs = {name: self._job(name) for name in names}

    def _job(self, name: str) -> _Ahead:
        fn = AHEAD[name][0]
        return _Ahead(lambda: fn(self.factory, self.value))

    def value(self, name: str) -> Any:
        """Fixture ``name``'s value: computed ahead, or now if the session did not queue it (e.g. a test asked for it
        through ``request.getfixturevalue``)."""
        if name not in self.jobs:
            self.jobs[name] = self._job(name)
        return self.jobs[name].value()


@pytest.fixture(scope="session", autouse=True)
def ahead_jobs(request, tmp_path_factory, native_checks) -> AheadJobs:
    """The :func:`ahead` values this session's tests use, computed one at a time by a background thread, in the order
    the tests first use them; ``ahead_jobs.value(name)`` waits for one (or computes it, if not started yet)."""
    items = request.session.items
    first = {name: next((i for i, item in enumerate(items) if used(item)), None)
             for name, (_, used) in AHEAD.items()}
    queued = sorted((n for n in first if first[n] is not None), key=lambda n: first[n])
    # the session's temporary folder made here, before the thread: pytest makes it at the first getbasetemp(), and
    # two threads making it at once each make one (the second replaces the first under the other thread's mktemp,
    # whose check then fails: "cli is not a normalized and relative path", CI 2026-11-27)
    tmp_path_factory.getbasetemp()
    jobs = AheadJobs(tmp_path_factory, queued)
    stop = threading.Event()

    def work() -> None:
        for name in queued:
            if stop.is_set():
                return
            jobs.jobs[name].run()
    thread = threading.Thread(target=work, name="ahead", daemon=True)
    began = time.monotonic()
    thread.start()
    yield jobs
    stop.set()
    thread.join()
    if os.environ.get("GEARCACHE_TEST_AHEAD_LOG"):     # where the session's time goes: each job's span and waits
        with open(os.environ["GEARCACHE_TEST_AHEAD_LOG"], "w") as f:
            json.dump({name: {k: (v - began if k in ("start", "end") else v) for k, v in job.times.items()}
                       for name, job in jobs.jobs.items()}, f, indent=1)


@pytest.fixture(scope="module", autouse=True)
def _freeze_survivors() -> None:
    """Before each test module: collect the garbage the modules before it left, then freeze what survives (torch's,
    Dynamo's and Inductor's modules, session fixtures) out of the collector's later full passes, which walked it
    all again and again (a tenth of the test process's time on a 2-core machine). Objects made from here on are
    collected as always; a survivor that turns into cyclic garbage later is not (memory only: nothing asserts on it)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config) -> None:
    """The session is over: exit without the interpreter's final collection over every object (seconds)."""
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def native_checks() -> str:
    """The path of gearcache's native checks (gearcache/native/), built before any test runs, so that this process
    and every script it starts load them (none starts a background build). Built once per source and torch build: a
    later session loads it from the user's cache folder. A test that wants Dynamo's checks instead takes ``checks``."""
    from gearcache.native import build

    return build.build()


@pytest.fixture(params=["native", "dynamo"])
def checks(request, monkeypatch) -> str:
    """Run a test with each implementation of the dispatch shortcut's checks: gearcache's native module, or Dynamo's
    (``GEARCACHE_NATIVE=0``). The calling thread's cached state snapshot is dropped first (signature.state_tag)."""
    from gearcache.call import signature

    if request.param == "dynamo":
        monkeypatch.setenv("GEARCACHE_NATIVE", "0")
    signature._snapshot.same = None
    yield request.param
    signature._snapshot.same = None


@ahead("tiny_lm_cache")
def _tiny_lm_cache(tmp_path_factory, need) -> tuple[Path, dict]:
    cache = tmp_path_factory.mktemp("tiny_lm_cache")
    env = {**empty_caches_env(tmp_path_factory.mktemp("tiny_lm_torch_caches")), **DEFAULT_PCH}
    return cache, run_script("run_tiny_lm.py", str(cache), "--hooks", env=env)


@pytest.fixture(scope="session")
def tiny_lm_cache(ahead_jobs) -> tuple[Path, dict]:
    """(cache folder, report): TinyLM's prefill and decode entries, compiled by a separate (cold) process with compile
    hooks installed (tests/compile_hooks.py: the report's ``hooks`` counts what the cold compile ran) and empty
    Inductor and Triton caches."""
    return ahead_jobs.value("tiny_lm_cache")


@ahead("tiny_lm_warm")
def _tiny_lm_warm(tmp_path_factory, need) -> dict[str, dict]:
    cache, _ = need("tiny_lm_cache")
    scripts = {"plain": Script("run_tiny_lm.py", str(cache),
                               env={**empty_caches_env(tmp_path_factory.mktemp("tiny_lm_plain_torch_caches")),
                                    **DEFAULT_PCH}),
               "hooks": Script("run_tiny_lm.py", str(cache), "--hooks", "--mutate-weights",
                               env={**empty_caches_env(tmp_path_factory.mktemp("tiny_lm_hooks_torch_caches")),
                                    **DEFAULT_PCH}),
               "python": Script("run_tiny_lm.py", str(cache), "--hooks", "--mutate-weights", "--no-c-extension",
                                env={**empty_caches_env(tmp_path_factory.mktemp("tiny_lm_python_torch_caches")),
                                     "GEARCACHE_NATIVE": "0", **DEFAULT_PCH})}
    return {name: script.result() for name, script in scripts.items()}


@pytest.fixture(scope="session")
def tiny_lm_warm(ahead_jobs) -> dict[str, dict]:
    """Reports of TinyLM run again on ``tiny_lm_cache`` by three fresh processes (run at once), each with empty
    Inductor and Triton caches: ``"plain"`` as a server would (no hooks: nothing imports torch's compiler for it),
    ``"hooks"`` with compile hooks installed, which after the first calls also changes the weights (in place, a new
    Parameter, a buffer) and calls prefill again (``--hooks --mutate-weights``: hooks and counters cover it all); and
    ``"python"``, like ``"hooks"`` but as where neither gearcache's C extension (``--no-c-extension``) nor its native
    checks (``GEARCACHE_NATIVE=0``: Dynamo's checks) are built."""
    return ahead_jobs.value("tiny_lm_warm")


@ahead("gears_cache")
def _gears_cache(tmp_path_factory, need) -> tuple[Path, dict]:
    cache = tmp_path_factory.mktemp("gears_cache")
    return cache, run_script("run_gears.py", str(cache), "--workers", "1")


@pytest.fixture(scope="session")
def gears_cache(ahead_jobs) -> tuple[Path, dict]:
    """A cache folder holding PairMLP's three gears, warmed up serially by a separate (cold) process
    (tests/scripts/run_gears.py)."""
    return ahead_jobs.value("gears_cache")


@pytest.fixture()
def empty_torch_caches(tmp_path) -> dict:
    """Environment pointing Inductor's and Triton's caches at empty folders."""
    env = empty_caches_env(tmp_path)
    for folder in env.values():
        os.mkdir(folder)
    return env


# the corpus models the tests run (test_corpus.py, test_integrations_*.py)
CORPUS_MODELS = ("bert", "llama", "mistral_sliding", "gemma3")


@pytest.fixture(scope="session")
def corpus_cold(tmp_path_factory):
    """``corpus_cold(name)``: (store, report) of corpus model ``name`` (benchmarks/corpus.py, tiny, CPU) run cold in a
    fresh process; each model is compiled once per session. The first call starts every model of ``CORPUS_MODELS``
    at once (each in its own process and store), later calls wait for theirs."""
    started: dict[str, tuple[Path, Script]] = {}

    def cold(name: str) -> tuple[Path, dict]:
        for n in dict.fromkeys((name, *CORPUS_MODELS)):
            if n not in started:
                store = tmp_path_factory.mktemp(f"corpus_{n}")
                started[n] = store, Script("run_corpus_model.py", n, str(store))
        store, script = started[name]
        return store, script.result(timeout=900)
    yield cold
    for _, script in started.values():
        script.kill()


@pytest.fixture(scope="session")
def corpus_warm(corpus_cold, tmp_path_factory):
    """``corpus_warm(name)``: the report of corpus model ``name`` run again on its cold store, in a fresh process with
    compile hooks installed and empty Inductor and Triton caches; once per session. The first call starts the warm
    process of every model of ``CORPUS_MODELS`` at once (after their cold runs), later calls wait for theirs."""
    started: dict[str, Script] = {}

    def warm(name: str) -> dict:
        for n in dict.fromkeys((name, *CORPUS_MODELS)):
            if n not in started:
                store, _ = corpus_cold(n)
                env = empty_caches_env(tmp_path_factory.mktemp(f"corpus_{n}_torch_caches"))
                started[n] = Script("run_corpus_model.py", n, str(store), "--hooks", env=env)
        return started[name].result(timeout=600)
    yield warm
    for script in started.values():
        script.kill()


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session (free loopback port, no persistence), stopped after."""
    from redis_server import start

    server = start()
    yield server
    server.stop()


@pytest.fixture()
def redis(redis_server):
    """The session's redis-server, emptied for this test (restarted if a test killed it)."""
    if redis_server.proc.poll() is not None:
        redis_server.start()
    client = redis_server.client()
    client.config_set("maxmemory", 0)
    client.flushall()
    yield redis_server
    if redis_server.proc.poll() is not None:
        redis_server.start()


FLEET_KEY = "fleet-test-key"


def fleet_config(redis_url: str | None, **extra) -> str:
    """tests/scripts/fleet_node.py's config: signed with FLEET_KEY, 4 KiB chunks (an artifact spans many)."""
    return json.dumps({"signing_key": FLEET_KEY, "remote": redis_url, "remote_chunk_bytes": 4096, **extra})


@ahead("seed")
def _seed(tmp_path_factory, need) -> Path:
    folder = tmp_path_factory.mktemp("fleet_seed")
    report = run_script("fleet_node.py", str(folder), fleet_config(None))
    assert report["compiles"] == 1 and report["equal"]
    return folder


@pytest.fixture(scope="session")
def seed(ahead_jobs) -> Path:
    """A local folder holding fleet_node.py's entry, compiled once (signed with FLEET_KEY) by a fresh process."""
    return ahead_jobs.value("seed")
