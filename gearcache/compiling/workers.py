"""Compile captured graphs in worker processes (parallel warm-up).

A worker is a plain ``python`` subprocess running :func:`main`, so the caller's ``__main__`` is never re-imported
(as multiprocessing's "spawn" would) and no CUDA state is inherited (as "fork" would). It serves jobs one at a time
over its stdin and stdout; each message is an 8-byte big-endian length then a pickle:

* job (caller → worker): ``{"graph": bytes from _torch.worker_compile.graph_to_bytes, "inputs": [input spec], "folder":
  str, "patches": {Inductor setting: value}, "settings": _torch.worker_compile.compiler_settings(), "grad": bool,
  "inference": bool, "global_state": _torch.state.global_state()}`` (the compile runs under the caller's autocast,
  TF32 flags, ...: they change what AOTAutograd traces and Inductor generates); an input spec is ``["tensor", shape,
  stride, storage_offset, dtype, device, requires_grad, is_parameter, is_inference]`` or ``["value", v]``;
* reply (worker → caller): ``{"ok": True, "seconds": float, "times": {...}}`` or ``{"ok": False, "error": str,
  "times": {...}}``; ``times`` are the worker's ``time.time()`` stamps: ``started`` (its interpreter ran the first
  line), ``ready`` (torch and the compiler imported, Inductor's compile pool started), ``job_start``, ``job_end``.

The worker rebuilds the example inputs as zero-filled tensors of the same metadata (the compile depends on shapes,
strides, offsets, dtypes and devices, never on values) and runs ``_torch.inductor.compile_unloaded`` into ``folder``;
the caller then loads the folder and writes its run plan from the real inputs (``pipeline.finish_artifact``).
Workers start when warm-up starts and import torch, Inductor and its compile pool before their first job
(``_torch.worker_compile.warm_up_compiler``), so that cost overlaps the caller's first captures. A worker's own Inductor
uses :func:`compile_threads` threads. Pickles come only from the process that started
the worker (its own pipes), never from the cache folder.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any, BinaryIO, cast

import torch

from .._torch import inductor as torch_inductor, state as torch_state, worker_compile as torch_worker_compile
from ..call import memory
from ..errors import WorkerError
from ..runplan.collectives import communicates

log = logging.getLogger("gearcache.compiling.workers")
_LEN = struct.Struct(">Q")
_WORKER_MAIN = "import time; t = time.time(); from gearcache.compiling.workers import main; main(t)"


# ------------------------------------------------------------------------------------------------ message framing
def _pipe(stream: IO[bytes] | None) -> BinaryIO:
    """A worker's stdin or stdout: a pipe (the pool starts every worker with both), never None."""
    return cast(BinaryIO, stream)


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the pipe closed")
    size = _LEN.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the pipe closed mid-message")
    return pickle.loads(data)


# --------------------------------------------------------------------------------------------------- input specs
def input_spec(x: Any) -> list[Any]:
    """What a worker needs to rebuild example input ``x`` (see the module docstring)."""
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), list(x.stride()), x.storage_offset(), str(x.dtype).split(".")[-1],
                str(x.device), x.requires_grad, isinstance(x, torch.nn.Parameter), x.is_inference()]
    return ["value", x]


def build_input(spec: list[Any]) -> Any:
    """A zero-filled tensor with the metadata of ``spec`` (or the plain value)."""
    if spec[0] == "value":
        return spec[1]
    _, shape, stride, offset, dtype, device, requires_grad, is_parameter, is_inference = spec
    needed = offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else offset
    with torch.inference_mode(is_inference):       # a parameter made under inference mode is an inference tensor
        base = torch.zeros(max(needed, 0), dtype=getattr(torch, dtype), device=device)
        t = base.as_strided(shape, stride, offset)
        if is_parameter:
            return torch.nn.Parameter(t, requires_grad=requires_grad)
        return t.requires_grad_(requires_grad) if requires_grad else t


# --------------------------------------------------------------------------------------------------- worker side
def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    import pathlib

    t0 = time.perf_counter()
    torch_worker_compile.apply_compiler_settings(job["settings"])
    gm = torch_worker_compile.graph_from_bytes(job["graph"])
    inputs = [build_input(s) for s in job["inputs"]]
    with torch_state.global_state_applied(job["global_state"]), torch.inference_mode(job["inference"]), \
            torch.set_grad_enabled(job["grad"]):
        torch_inductor.compile_unloaded(gm, inputs, pathlib.Path(job["folder"]), config_patches=job["patches"])
    return {"ok": True, "seconds": time.perf_counter() - t0}


def main(started: float | None = None) -> None:
    """Serve jobs until stdin closes. Replies go to the real stdout; anything else printed goes to stderr.
    ``started``: the ``time.time()`` of the interpreter's first line (reported in replies)."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())           # stray prints must not corrupt the replies
    torch_worker_compile.warm_up_compiler()          # while the caller is still capturing
    times = {"started": started or time.time(), "ready": time.time()}
    jobs = sys.stdin.buffer
    while True:
        try:
            job = _receive(jobs)
        except EOFError:
            return
        times["job_start"] = time.time()
        try:
            reply = _run_job(job)
        except BaseException as exc:                            # noqa: BLE001 - reported to the caller
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        times["job_end"] = time.time()
        _send(out, {**reply, "times": dict(times)})


# --------------------------------------------------------------------------------------------------- caller side
def compile_threads(workers: int, cores: int) -> int:
    """Inductor compile threads per worker: ``ceil(2 * cores / workers)``, at most ``cores``, at least 1.

    Twice the fair share: a worker's compile threads are busy only while it builds kernels (Triton or C++), not while
    it traces, partitions and lowers on one thread, and workers are seldom all in that phase at once."""
    return max(1, min(cores, -(-2 * cores // max(1, workers))))


class WorkerPool:
    """``n`` worker processes, started at once (their imports overlap the caller's captures); :meth:`compile` is
    thread-safe and blocks until an idle worker has compiled the job. Use as a context manager: leaving it closes
    the workers' stdin and waits for them."""

    def __init__(self, n: int):
        threads = str(compile_threads(n, os.cpu_count() or 1))
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": threads}
        env["PYTHONPATH"] = os.pathsep.join(p for p in [_package_parent(), env.get("PYTHONPATH")] if p)
        self._env = env
        self._idle: "queue.Queue[subprocess.Popen[bytes]]" = queue.Queue()
        self._all: list[subprocess.Popen[bytes]] = []
        for _ in range(n):
            proc = self._spawn()
            self._all.append(proc)
            self._idle.put(proc)

    def _spawn(self) -> "subprocess.Popen[bytes]":
        return subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=self._env)

    @property
    def size(self) -> int:
        """How many worker processes were started."""
        return len(self._all)

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids."""
        return [proc.pid for proc in self._all]

    def compile(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run ``job`` in a worker; returns its reply (``seconds``, ``times``, see the module docstring) with
        ``worker`` (its index in the pool) added. ``WorkerError`` if the worker failed or died during the job; a
        worker found dead before it (killed, out of memory, since its last job) is replaced by a fresh one first, so
        one death does not fail every later job of a pool that stays open (background compiles)."""
        proc = self._idle.get()
        if proc.poll() is not None:
            log.warning("worker pid %s exited with code %s; starting a fresh one", proc.pid, proc.returncode)
            fresh = self._spawn()
            self._all[self._all.index(proc)] = fresh
            proc = fresh
        try:
            _send(_pipe(proc.stdin), job)
            reply = _receive(_pipe(proc.stdout))
        except (OSError, EOFError) as exc:
            raise WorkerError(f"worker pid {proc.pid} died ({type(exc).__name__}: {exc}; exit code "
                              f"{proc.poll()})", proc.pid) from None
        finally:
            self._idle.put(proc)                # a dead one is replaced when it is next taken
        if not reply["ok"]:
            raise WorkerError(reply["error"], proc.pid)
        return {**reply, "worker": self._all.index(proc)}

    def close(self, wait: bool = True) -> None:
        """Close the workers' stdin (they exit when it closes) and reap them; ``wait=False`` reaps them in a
        daemon thread instead, so the caller goes on while they shut their compile pools down (about a second)."""
        for proc in self._all:
            try:
                _pipe(proc.stdin).close()
            except OSError:
                pass
        if wait:
            self._reap()
        else:
            threading.Thread(target=self._reap, name="gearcache-warmup-reaper", daemon=True).start()

    def _reap(self) -> None:
        for proc in self._all:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _package_parent() -> str:
    """The folder holding the ``gearcache`` package this process imported (the worker imports the same one)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------ jobs and sizes
WORKER_HOST_BYTES = 2 << 30         # a worker's own memory (torch, Inductor, its compile), besides its input copies
WORKER_DEVICE_BYTES = 1 << 30       # a worker's CUDA context and compile scratch on the GPU


def job_for(gm: torch.fx.GraphModule, example_inputs: list[Any], patches: dict[str, Any],
            who: str) -> dict[str, Any] | None:
    """The job (see the module docstring; without ``folder``) compiling ``gm`` on inputs like ``example_inputs`` under
    the calling thread's compiler settings, grad mode, inference mode and global state; None when the graph cannot
    travel to a worker (it calls collectives, whose process groups only this process has, or torch cannot pickle one of
    its calls, or a custom Inductor pass is set: ``_torch.inductor.custom_passes``), or two of its inputs share memory
    (a worker rebuilds each input on a base of its own: module tensors that are views of one tensor, one written, were
    compiled apart there, and the entry read the other before the write: eager [82], gearcache [60]; arguments so under
    ``on_new_signature="background"``: [5, 10] and [5, 8]): the caller compiles it in-process. ``who``: names the graph
    in the log. Cost: a storage range per input, per gear compiled."""
    if communicates(gm):
        log.info("%s is compiled in this process: its graph calls collectives, whose process groups only this "
                 "process has", who)
        return None
    if torch_inductor.custom_passes():
        log.info("%s is compiled in this process: it is compiled under a custom Inductor pass, which a worker's "
                 "settings cannot carry", who)
        return None
    if not memory.ranges_apart(tuple(example_inputs)):
        log.info("%s is compiled in this process: inputs of its graph share memory (views of one tensor), which a "
                 "worker, rebuilding each input on a base of its own, would compile apart", who)
        return None
    try:
        graph = torch_worker_compile.graph_to_bytes(gm)
    except Exception as exc:                                    # noqa: BLE001 - compiled in-process instead
        log.info("%s is compiled in this process: its graph cannot be sent to a worker (%s: %s)", who,
                 type(exc).__name__, exc)
        return None
    return {"graph": graph, "inputs": [input_spec(x) for x in example_inputs], "patches": patches,
            "settings": torch_worker_compile.compiler_settings(), "grad": torch.is_grad_enabled(),
            "inference": torch.is_inference_mode_enabled(), "global_state": torch_state.global_state()}


def default_workers(missing: int, example_inputs: list[Any]) -> int:
    """``min(missing gears, cores per local rank / 2, host memory / worker, GPU memory / worker)``, at least 1.

    Half the cores: each compile builds its kernels on several threads itself (Inductor's compile threads), and a
    worker's start (importing torch) costs seconds of a core; on 2 or 3 cores per rank the default is the serial path.

    A worker holds zero-filled copies of the graph's example inputs (weights included) on their devices, so the caps
    count them: host memory available / (2 GiB + CPU input bytes), free GPU memory / (1 GiB + GPU input bytes).
    Local ranks: torchrun's ``LOCAL_WORLD_SIZE`` (1 without it)."""
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    caps = [missing, (os.cpu_count() or 1) // local_ranks // 2]
    cpu_bytes = sum(_nbytes(x) for x in example_inputs if _nbytes(x) and x.device.type == "cpu")
    cuda_bytes = sum(_nbytes(x) for x in example_inputs if _nbytes(x) and x.device.type == "cuda")
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        caps.append(available // local_ranks // (WORKER_HOST_BYTES + cpu_bytes))
    except (ValueError, OSError, AttributeError):
        pass
    if cuda_bytes:
        device = next(x.device for x in example_inputs if _nbytes(x) and x.device.type == "cuda")
        free, _ = torch.cuda.mem_get_info(device)
        caps.append(free // local_ranks // (WORKER_DEVICE_BYTES + cuda_bytes))
    return max(1, min(caps))


def _nbytes(x: Any) -> int:
    return x.untyped_storage().nbytes() if isinstance(x, torch.Tensor) else 0
