"""User configuration: ``CompilerConfig`` and its ``inference_config``.

A config is plain data. It validates every field on construction *and on assignment* (pydantic), carries no runtime
state, and loads from a JSON or TOML file (``CompilerConfig.from_file("configs/llm_decode.toml")``).

Only the fields returned by :meth:`CompilerConfig.compile_factors` change the compiled code; they are part of every
cache key. The other fields steer runtime behaviour (what to do on a miss, lock timeouts, gears) and are not.
"""
from __future__ import annotations

import json
import pathlib
import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import ConfigError

MergePolicy = Literal["zip", "product"]


def normalise_sizes(sizes: Any, where: str) -> list[int]:
    if isinstance(sizes, int) and not isinstance(sizes, bool):
        sizes = [sizes]
    if not isinstance(sizes, (list, tuple)) or not sizes:
        raise ValueError(f"{where}: expected a non-empty list of sizes, got {sizes!r}; e.g. [1, 2, 4, 8]")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise ValueError(f"{where}: gear sizes must be positive integers, got {s!r} in {list(sizes)!r}")
    return sorted(set(sizes))


def normalise_dim_gears(dim_gears: Any, where: str = "dim_gears") -> dict[int, list[int]]:
    """Validate ``{dim: [sizes]}``: integer dims, positive integer sizes; sizes deduplicated and sorted."""
    if not isinstance(dim_gears, dict) or not dim_gears:
        raise ValueError(f"{where}: expected a dict {{dim: [sizes]}}, e.g. {{0: [1, 2, 4, 8]}}, got {dim_gears!r}")
    out: dict[int, list[int]] = {}
    for dim, sizes in dim_gears.items():
        if isinstance(dim, str) and dim.lstrip("-").isdigit():
            dim = int(dim)          # JSON and TOML keys are strings
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"{where}: dims must be integers, got {dim!r}")
        out[dim] = normalise_sizes(sizes, f"{where}[{dim}]")
    return out


class InferenceConfig(BaseModel):
    """How calls are mapped onto compiled entries (gears). None of these fields change the compiled code."""

    model_config = ConfigDict(validate_assignment=True, extra="forbid")

    dynamic_gears_merge_policy: MergePolicy = "zip"
    """``"zip"``: the i-th size of every marked dim forms gear i. ``"product"``: every combination."""

    dim_gears: dict[str, dict[int, list[int]]] = Field(default_factory=dict)
    """Gears declared by argument name, for processes that do not mark tensors: ``{"x": {0: [1, 2, 4]}}``."""

    pad_values: dict[str, bool | int | float] = Field(default_factory=dict)
    """Value used to pad each named argument up to its gear (a pad token id, a mask value). An argument not named here
    (and not marked with ``set_dim_gears(..., pad_value=)``) gets the value gearcache's padding analysis chooses:
    one that keeps every op reading the padded rows exact (``+inf`` before a min over them, ``0`` before a sum...),
    0 where any value does. A value given here is kept; a plan it makes inexact is refused."""

    past_largest_gear: Literal["error", "eager", "compile"] = "error"
    """A call larger than the largest gear: raise, run uncompiled (warned once, counted), or add an exact entry."""

    graph_outputs: Literal["copy", "view", "view-checked"] = "copy"
    """Under mode="reduce-overhead": return copies of the CUDA graph's outputs, or views into its static outputs
    (no copy; valid until the method's next call, whatever its gear: the gears' graphs share one memory pool), or such
    views checked for misuse (reading a view after the method's next call raises an error naming the fix, as
    torch's CUDA-graph trees do; 16-57 µs more host time per call than "view" on an H200 host, hidden while the GPU
    is the bottleneck)."""

    capture_graphs: Literal["warmup", "first_call"] = "warmup"
    """Under mode="reduce-overhead", when each gear's CUDA graph is captured. ``"warmup"``: ``warmup()`` loads every
    gear's entry and captures every graph, largest gear first (one shared memory pool; a warm start pays the capture
    of all gears, and no call ever captures). ``"first_call"``: ``warmup()`` only loads the entries; each gear is
    captured on its first call (a faster warm start, and memory only for the gears a workload uses, but that first
    call pays one warm-up run plus the capture, a few ms, and gears captured smallest first may grow the pool more
    than largest first would)."""

    padding_check: Literal["refuse", "verify", "off"] = "refuse"
    """What gearcache does with the padding analysis of a geared method (gearcache/gears/padding.py, padding_check.py).
    ``"refuse"`` (the default): a gear plan is served only where the analysis proves padding exact, for every call:
    each op reading padded rows keeps them apart from the real ones, or sees them only through a pad value neutral
    for it (chosen per padded input). Anything else (a write that padding would spread into a parameter, a buffer or
    an unpadded input; a mean over a padded dim; an op without a rule) raises ``PaddingUnsafeError`` when the plan is
    built or loaded, before anything compiles or runs, naming the op, the source line and the fix. ``"verify"``: the
    same, and each gear is also run against eager in float64 before its first padded call (every gear at
    ``warmup()``): an opt-in test of the analysis itself, which raises if padding changed a result the analysis
    proved exact (a gearcache bug). ``"off"``: nothing is refused or tested (you assert that padding is exact)."""

    warmup_workers: int | None = Field(default=None, ge=1)
    """Worker processes that compile the gears ``warmup()`` finds missing, side by side (each gear is still captured
    in the calling process). ``None``: as many as there are missing gears, half the cores per local rank and memory
    for (gearcache/warmup/driver.py ``default_workers``); ``1``: one gear after another in the calling process."""

    @model_validator(mode="before")
    @classmethod
    def _merged_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "verify_padding" in data:
            raise ValueError(f"verify_padding={data['verify_padding']!r}: merged into padding_check (issue #37). Fix: "
                             f"padding_check='verify' tests every gear against eager at warmup() and before its first "
                             f"padded call; drop verify_padding")
        return data

    @field_validator("dim_gears", mode="before")
    @classmethod
    def _check_dim_gears(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError(f"dim_gears: expected {{argument_name: {{dim: [sizes]}}}}, got {value!r}")
        return {name: normalise_dim_gears(g, f"dim_gears[{name!r}]") for name, g in value.items()}


class CompilerConfig(BaseModel):
    """Everything ``cache_compile`` can be told. Validates on assignment; ``from_file`` loads JSON or TOML."""

    model_config = ConfigDict(validate_assignment=True, extra="forbid")

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """Inductor's mode, as in ``torch.compile(mode=...)``."""

    inductor_options: dict[str, Any] = Field(default_factory=dict)
    """Extra ``torch._inductor.config`` settings for the compile, e.g. ``{"coordinate_descent_tuning": True}``."""

    inference_config: InferenceConfig = Field(default_factory=InferenceConfig)

    on_new_signature: Literal["compile", "background", "error"] = "compile"
    """A call whose inputs match no entry the store has: compile a new entry (the call waits for it); compile it in
    a worker process while this call and the signature's next ones run the method eagerly, until it is done
    (``"background"``, gearcache/compiling/background.py: ``gearcache.wait_for_background_compiles()`` waits); or raise
    ``SignatureMismatchError``."""

    check_signature: bool = True
    """Look each call's shapes, dtypes and devices up in the entry table. ``False`` skips even that and sends every
    call to the first entry: only for callers that guarantee one fixed signature (and the same grad mode, inference
    mode and global torch state, e.g. autocast, as that first call). Calls with keyword, nested or Python scalar
    arguments (a scalar's value is compiled into the graph: each value keys its own entry), a first
    entry compiled for arguments sharing memory, and, for an entry writing an argument, calls whose tensors share
    memory still take the checked path (their sharing is no part of what a caller guarantees), and so do calls with
    another number of arguments, a non-tensor where the first entry has a tensor, or a tensor subclass. A call at
    another shape, stride, dtype or device raises ``SignatureMismatchError`` (dtypes and devices compared per call,
    ~0.25 us a tensor)."""

    lock_timeout_s: float = Field(default=900.0, gt=0)
    """How long a process waits for another that is compiling the same artifact."""

    rank_timeout_s: float = Field(default=3600.0, gt=0)
    """How long a rank of a process group waits at ``warmup()``'s fence (gearcache/ranks/phases.py) for the other
    ranks of
    the groups its graphs' collectives use to finish their compiles and arrive; then ``RankWaitError`` names the ranks
    that did not and what each last reported doing. Every rank waits there for the slowest one's compiles."""

    lock_mode: Literal["flock", "soft"] = "flock"
    """``"flock"``: kernel locks (released when a process dies). ``"soft"``: lock files (``filelock.SoftFileLock``) for
    network filesystems without working ``flock``; a soft lock whose holder died on this host, or older than
    ``lock_timeout_s``, is removed. Every process sharing a folder must use the same mode."""

    max_size: int | None = Field(default=None, gt=0)
    """Bytes of compiled artifacts the folder may hold. Publishing past it evicts the least recently used artifacts
    (with their entries) that no live process has loaded. ``None``: unbounded."""

    signing_key: str | None = Field(default=None, repr=False)
    """HMAC-SHA256 key (else ``$GEARCACHE_SIGNING_KEY``). With a key, artifacts and entry manifests are signed when
    written, and unsigned or wrongly signed ones are never loaded (quarantined and rebuilt). Not a key factor."""

    trust_shared_folder: bool = False
    """With a signing key: accept a group-writable (or group member owned) folder, signatures being the protection.
    Without a key it changes nothing."""

    remote: str | None = None
    """A remote store shared by a fleet, behind the local folder (else ``$GEARCACHE_REMOTE``): ``"redis://host:6379/0"``.
    A local miss fetches the entry and its artifact from it (checked, then published locally); a compile publishes
    to both, and one process of the whole fleet compiles each artifact. Requires a signing key unless
    ``remote_trust="unsigned-ok"``. A remote fault never fails a call: the local folder carries on alone."""

    remote_trust: Literal["signed", "unsigned-ok"] = "signed"
    """``"signed"``: a remote store needs a signing key; unsigned or wrongly signed remote entries are refused and
    rebuilt. ``"unsigned-ok"``: allow a remote store without a key (warned: any client of the server can then make
    this process run its code)."""

    remote_timeout_s: float = Field(default=5.0, gt=0)
    """Bound on every remote command (connect and reply); a fault leaves the remote alone for 30 s."""

    remote_chunk_bytes: int = Field(default=4 << 20, ge=1024)
    """Artifacts are stored in chunks of this many bytes (the entry's head key is written after all of them)."""

    remote_claim_ttl_s: float = Field(default=20.0, gt=0)
    """A fleet process compiling an artifact holds a claim that expires after this long unless refreshed (every
    third of it) while the compile runs: a compiler that dies is replaced by a waiter within this time."""

    on_cache_error: Literal["memory", "eager", "raise"] = "memory"
    """The store cannot be written (read-only, disk full, vanished, untrusted, lock timeout): compile and run without
    persisting (``"memory"``), run the method uncompiled (``"eager"``, warned, counted in ``counters.eager_calls``),
    or raise. A warning names the error and the fix once per process."""

    @field_validator("inductor_options")
    @classmethod
    def _check_inductor_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        from ._torch import inductor as torch_inductor

        known = torch_inductor.inductor_setting_names()
        for name in value:
            if name not in known:
                raise ValueError(f"inductor_options: {name!r} is not a torch._inductor.config setting "
                                 f"(see torch._inductor.config for the names)")
            if name in ("triton.cudagraphs", "triton.cudagraph_trees"):
                raise ValueError(f"inductor_options: {name!r} is not supported; use mode='reduce-overhead'")
        return value

    def compile_factors(self) -> dict[str, Any]:
        """What changes the compiled code, in a stable JSON-able form (a cache key factor): the mode as compiled plus
        ``inductor_options`` (computed without importing torch's compiler: a warm start must not), and, where this
        process set any in code, the Inductor and AOTAutograd settings the compile runs under
        (``"compiler_settings"``: ``_torch.inductor.changed_compiler_settings``; left out when there is none, so
        keys without are as before). Without them, a process that set ``torch._inductor.config.
        emulate_precision_casts = True`` loaded an entry compiled without it (1.7e-3 off eager where its own compile
        gives 6e-8); and, likewise left out when there is none, the ``TORCHINDUCTOR_*`` environment variables that may
        change the code (``"compiler_environment"``: ``_torch.inductor.compiler_environment``: a process started with
        ``TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1`` loaded an entry compiled without it, 0.125 off eager where its
        own compile is exact). ``"reduce-overhead"`` compiles like ``"default"`` (its CUDA graphs are captured per
        process), so the two share entries. A setting changed after a signature was served is seen at its next miss, not
        by the signatures already in the process's table."""
        from ._torch import inductor as torch_inductor

        factors: dict[str, Any] = {"mode": torch_inductor.compiled_mode(self.mode),
                                   "inductor_options": {k: repr(v) for k, v in sorted(self.inductor_options.items())}}
        settings = torch_inductor.changed_compiler_settings()
        if settings:
            factors["compiler_settings"] = settings
        environment = torch_inductor.compiler_environment()
        if environment:
            factors["compiler_environment"] = environment
        return factors

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> "CompilerConfig":
        """Load a config from a ``.json`` or ``.toml`` file (see ``configs/`` for examples)."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"CompilerConfig.from_file: path={str(path)!r} is not a file")
        if path.suffix not in (".json", ".toml"):
            raise ConfigError(f"CompilerConfig.from_file: path={str(path)!r} must end in .json or .toml")
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except ValueError as exc:
            raise ConfigError(f"CompilerConfig.from_file: path={str(path)!r} is not valid {path.suffix[1:]}: "
                              f"{exc}") from exc
        return cls.model_validate(data)
