"""Compile ``guards.cpp`` against the running torch's headers into ``<native dir>/<key>/`` (see ``gearcache.native``).

    python -m gearcache.native.build            # build now, in this process (exit 0: built or already there)
    python -m gearcache.native.build --if-idle  # what the background build runs: skip if another build holds the
                                                # lock or an earlier try failed

One build per key at a time (a ``filelock`` on ``.lock``); the module is compiled to a temporary name in the key's
folder and published with ``os.replace``, the last step, so a reader sees the whole file or none. A failed try
leaves ``failed`` (and the compiler's output in ``build.log``): automatic builds do not retry it; ``build()`` and
``gearcache native build`` do.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from typing import NoReturn

import filelock

from ..errors import NativeBuildError
from . import FAILED_FILE, LOCK_FILE, LOG_FILE, MODULE_FILE, SOURCE, extension_key, key_dir

COMPILE_TIMEOUT_S = 600


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++``, ``g++`` or ``clang++`` on the PATH; None if there is none."""
    found = (shutil.which(name) for name in (os.environ.get("CXX"), "c++", "g++", "clang++") if name)
    return next((path for path in found if path), None)


def compile_command(cxx: str, output: str, key: str) -> list[str]:
    """The command line that builds the module from ``SOURCE`` into ``output`` for this process's torch and Python."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    torch_lib = os.path.join(torch_dir, "lib")
    abi = int(torch.compiled_with_cxx11_abi())
    return [cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f'-DGEARCACHE_BUILD_KEY="{key}"',
            "-I", os.path.join(torch_dir, "include"),
            "-I", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
            "-I", sysconfig.get_paths()["include"],
            SOURCE, "-o", output,
            "-L", torch_lib, "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]


def build(*, retry_failed: bool = True, wait: bool = True) -> str | None:
    """Build the module for this process's torch unless it is there; returns its path. ``wait=False``: return None
    at once if another process is building it. ``retry_failed=False``: return None if an earlier try failed.
    Raises :class:`NativeBuildError` when the compiler fails or there is none (the reason is also in ``build.log``)."""
    key = extension_key()
    folder = key_dir(key)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    lock = filelock.FileLock(os.path.join(folder, LOCK_FILE))
    try:
        lock.acquire(timeout=-1 if wait else 0)
    except filelock.Timeout:
        return None
    try:
        target = os.path.join(folder, MODULE_FILE)
        if os.path.exists(target):
            return target
        failed = os.path.join(folder, FAILED_FILE)
        if os.path.exists(failed) and not retry_failed:
            return None
        return _compile(folder, key, target, failed)
    finally:
        lock.release()


def _compile(folder: str, key: str, target: str, failed: str) -> str:
    cxx = compiler()
    log_path = os.path.join(folder, LOG_FILE)
    if cxx is None:
        _record_failure(failed, log_path, "no C++ compiler found (set $CXX, or install g++)")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=".so")
    os.close(fd)
    command = compile_command(cxx, tmp, key)
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        output, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired:
        output, code = f"timed out after {COMPILE_TIMEOUT_S} s", -1
    if code != 0:
        os.unlink(tmp)
        _record_failure(failed, log_path, f"{' '.join(command)}\nexit status {code}\n{output}")
    with open(log_path, "w") as f:
        f.write(" ".join(command) + "\n" + output)
    os.chmod(tmp, 0o700)
    os.replace(tmp, target)
    if os.path.exists(failed):
        os.unlink(failed)
    return target


def _record_failure(failed: str, log_path: str, text: str) -> NoReturn:
    with open(log_path, "w") as f:
        f.write(text)
    with open(failed, "w") as f:
        f.write("see build.log\n")
    raise NativeBuildError(text.splitlines()[-1] if text else "", log_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gearcache.native.build", description=__doc__.splitlines()[0])
    parser.add_argument("--if-idle", action="store_true",
                        help="skip if another build is running or an earlier try failed")
    args = parser.parse_args(argv)
    if args.if_idle:
        os.nice(10)             # a background build: the serving process comes first
    try:
        path = build(retry_failed=not args.if_idle, wait=not args.if_idle)
    except NativeBuildError as e:
        print(e, file=sys.stderr)
        return 1
    if path:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
