"""``Layout``: every path of one cache folder (the layout is in this package's docstring), and what a listing of the
folder finds. Nothing here locks, checks trust or writes a file; every other part of the store names its paths here.
"""
from __future__ import annotations

import json
import os
import pathlib
import time
import uuid

from .files import HOST, MANIFEST, _folder_bytes, _makedirs, _mkdir, _tmp_tag


TORCH_FOLDER = "inductor"       # torch's unpacked artifact inside an artifact (or work) folder


class Layout:
    """The paths under ``root``; folders are created with ``dir_mode`` (0700, or 0770 for a shared folder)."""

    def __init__(self, root: pathlib.Path, dir_mode: int = 0o700):
        self.root, self.dir_mode = root, dir_mode
        self.artifacts = root / "artifacts"
        self.entries = root / "entries"
        self.index = root / "index"
        self.index_db = self.index / "cache.db"     # the diskcache index's SQLite file
        self.locks = root / "locks"
        self.leases = root / "leases"
        self.tmp = root / "tmp"
        self.quarantine = root / "quarantine"
        self.misses = root / "misses"
        self.stamps = root / "stamps"

    # ---------------------------------------------------------------------------------------------- artifacts
    def artifact(self, akey: str) -> pathlib.Path:
        return self.artifacts / akey

    def torch_artifact(self, akey: str) -> pathlib.Path:
        """torch's unpacked artifact inside artifact ``akey``: the generated code and kernels."""
        return self.artifact(akey) / TORCH_FOLDER

    def work(self, akey: str) -> pathlib.Path:
        """A new work folder name for artifact ``akey``, ``tmp/<akey>.<pid>.<tag>``: an artifact is built (or
        unpacked) there and renamed into ``artifacts/``, or moved there to be deleted. The pid and the host's tag
        let ``Maintenance.cleanup`` tell a dead process's leftovers."""
        return self.tmp / f"{akey}.{os.getpid()}.{_tmp_tag()}"

    def stamp(self, akey: str) -> pathlib.Path:
        """``stamps/<akey>.json``: what the last full check of artifact ``akey`` saw (stamps.py)."""
        return self.stamps / f"{akey}.json"

    def quarantined_artifact(self, akey: str) -> pathlib.Path:
        return self.quarantine / f"{akey}.{int(time.time())}.{uuid.uuid4().hex[:6]}"

    # ------------------------------------------------------------------------------------------------ entries
    def method(self, topology_folder: str, method: str) -> pathlib.Path:
        return self.entries / topology_folder / method

    def entry(self, topology_folder: str, method: str, ekey: str) -> pathlib.Path:
        return self.method(topology_folder, method) / f"{ekey}.json"

    def gear_plans(self, topology_folder: str, method: str) -> pathlib.Path:
        """The folder of a method's gear plans."""
        return self.method(topology_folder, method) / "plans"

    def gear_plan(self, topology_folder: str, method: str, pkey: str) -> pathlib.Path:
        return self.gear_plans(topology_folder, method) / f"{pkey}.json"

    def quarantined_entry(self, stem: str) -> pathlib.Path:
        return self.quarantine / "entries" / f"{stem}.{int(time.time())}.{uuid.uuid4().hex[:6]}.json"

    # ------------------------------------------------------------------------------------------------- misses
    def method_misses(self, topology_folder: str, method: str) -> pathlib.Path:
        """``misses/<topology>/<method>/``: the recorded misses of a method (``diagnostics.record_miss``)."""
        return self.misses / topology_folder / method

    def miss_files(self, method: str) -> list[pathlib.Path]:
        """Every recorded miss file of ``method`` (every topology), unsorted."""
        return list(self.misses.glob(f"*/{method}/*.json"))

    def missed_methods(self) -> set[str]:
        """The methods with a folder of recorded misses (any topology)."""
        return {p.name for p in self.misses.glob("*/*") if p.is_dir()}

    # ---------------------------------------------------------------------------------------- locks, leases, index
    def lock(self, name: str, kind: str = "", suffix: str = "lock") -> pathlib.Path:
        """``locks/<name>[.<kind>].<suffix>`` (``name``: an artifact key, or ``index``)."""
        return self.locks / (f"{name}.{kind}.{suffix}" if kind else f"{name}.{suffix}")

    def lease_folder(self, akey: str) -> pathlib.Path:
        return self.leases / akey

    def lease(self, akey: str, pid: int) -> pathlib.Path:
        """``leases/<akey>/<pid>@<host>``: process ``pid`` of this host has artifact ``akey`` loaded."""
        return self.lease_folder(akey) / f"{pid}@{HOST}"

    def quarantined_index(self) -> pathlib.Path:
        return self.quarantine / f"index.{int(time.time())}.{_tmp_tag()}"

    # ------------------------------------------------------------------------------------------------ folders
    def mkdir(self, path: pathlib.Path) -> None:
        """``mkdir`` of one folder (its parent exists) with this folder's mode."""
        _mkdir(path, self.dir_mode)

    def makedirs(self, path: pathlib.Path) -> None:
        """``mkdir -p`` with this folder's mode."""
        _makedirs(path, self.dir_mode)

    # ------------------------------------------------------------------------------------------------ listing
    def entry_files(self) -> list[pathlib.Path]:
        """Every entry manifest file (``entries/*/*/*.json``), unsorted."""
        return list(self.entries.glob("*/*/*.json"))

    def entry_keys(self) -> list[tuple[str, str, str]]:
        """``(topology folder, method, ekey)`` of every entry manifest file, readable or not, sorted."""
        return sorted((p.parent.parent.name, p.parent.name, p.stem) for p in self.entry_files())

    def artifact_keys(self) -> list[str]:
        """The key of every folder in ``artifacts/``, valid or not, sorted."""
        return sorted(p.name for p in self.artifacts.iterdir() if p.is_dir()) if self.artifacts.is_dir() else []

    def artifact_sizes(self) -> dict[str, tuple[int, float]]:
        """``{akey: (bytes, manifest mtime)}`` of the published artifacts."""
        out: dict[str, tuple[int, float]] = {}
        try:
            folders = list(self.artifacts.iterdir())
        except OSError:
            return out
        for folder in folders:
            try:
                st = (folder / MANIFEST).stat()
                size = json.loads((folder / MANIFEST).read_bytes()).get("bytes")
                if not isinstance(size, int):
                    size = _folder_bytes(folder)
            except (OSError, ValueError, AttributeError):
                continue                        # vanished meanwhile, or corrupt: not counted
            out[folder.name] = (size, st.st_mtime)
        return out
