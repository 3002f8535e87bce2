"""A differential-testing session: draw a run, run every case in this process and again in fresh processes, find
stale loads, shrink failures into reproducers, and report counts and coverage.

Layout of the work folder::

    src/       the program files (as this process imports them; rewritten for warm batch 1, then restored)
    store/     the one gearcache store every case of the session shares
    warm/      batch_<k>.json and results_<k>.json of the fresh processes
    repro/     case_<id>_<side>.py: a runnable reproducer per shrunk failure
    report.json  counts, coverage, failures, every case drawn and every result (Report.to_json)

Sides: ``main`` (this process: it compiles what no earlier case did) and ``warm`` (fresh processes started by
:func:`run_warm_batches`, one per batch: ``tests/scripts/difftest_warm.py``). A **stale load** is a case that used
an entry first used (so compiled) by a case whose method read other values (attributes, module constants): a key
that misses a value the graph bakes in.
"""
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import draw, programs, runner

TESTS = Path(__file__).resolve().parent.parent
FAILED = ("mismatch", "crash", "invalid")
UPSTREAM = "upstream"              # the same wrong answer as plain torch.compile: reported, not a gearcache failure


@dataclasses.dataclass
class Report:
    seed: int
    programs: list[dict]
    cases: list[dict]
    results: dict[str, dict[int, dict]]                 # side -> case id -> result
    stale: list[dict]
    seconds: dict[str, float]
    compile_identities: int
    plan_identities: int
    reproducers: dict[str, str] = dataclasses.field(default_factory=dict)    # "<id>/<side>" -> script path
    cpu_twins: dict[int, dict] = dataclasses.field(default_factory=dict)     # GPU run: case id -> CPU twin's result

    @property
    def gpu_only_refusals(self) -> list[dict]:
        """GPU cases refused whose CPU twin (the same program, gears and calls, mode "default" on the CPU) equals
        eager: a refusal that does not hold on every device."""
        return [{"id": i, "gpu": self.results["main"][i]["detail"][:300], "cpu": r["outcome"]}
                for i, r in sorted(self.cpu_twins.items()) if r["outcome"] == "equal"]

    def refusals(self, side: str) -> collections.Counter:
        """Why the cases of ``side`` were refused (:func:`refusal_reason`), counted."""
        return collections.Counter(refusal_reason(r["detail"]) for r in self.results.get(side, {}).values()
                                   if r["outcome"] == "refused")

    @property
    def upstream(self) -> list[dict]:
        """Mismatches plain torch.compile shares (a bug of torch's compiler that gearcache serves as it is)."""
        return [dict(r, id=i, side=side) for side, rs in self.results.items() for i, r in rs.items()
                if r["outcome"] == UPSTREAM]

    @property
    def failures(self) -> list[dict]:
        return [dict(r, id=i, side=side) for side, rs in self.results.items() for i, r in rs.items()
                if r["outcome"] in FAILED]

    def outcomes(self, side: str) -> collections.Counter:
        return collections.Counter(r["outcome"] for r in self.results.get(side, {}).values())

    def totals(self, side: str) -> dict[str, int]:
        total: collections.Counter = collections.Counter()
        for r in self.results.get(side, {}).values():
            total.update(r["counters"])
        return dict(total)

    def coverage(self) -> dict[str, collections.Counter]:
        """tag -> outcomes of the cases (both sides) that exercise it."""
        cov: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for case in self.cases:
            for side, rs in self.results.items():
                if case["id"] in rs:
                    for tag in case["tags"] + [f"side:{side}"]:
                        cov[tag][rs[case["id"]]["outcome"]] += 1
        return dict(sorted(cov.items()))

    def to_json(self) -> dict:
        """Counts, coverage, failures and every result (``work/report.json`` of a session)."""
        return {"seed": self.seed, "cases": len(self.cases), "programs": self.programs,
                "outcomes": {side: dict(self.outcomes(side)) for side in self.results},
                "totals": {side: self.totals(side) for side in self.results}, "stale": self.stale,
                "coverage": {tag: dict(c) for tag, c in self.coverage().items()}, "seconds": self.seconds,
                "failures": self.failures, "reproducers": self.reproducers,
                "refusals": {side: dict(self.refusals(side)) for side in self.results},
                "gpu_only_refusals": self.gpu_only_refusals,
                "compile_identities": self.compile_identities,
                "results": {side: {str(i): r for i, r in rs.items()} for side, rs in self.results.items()}}

    def summary(self) -> str:
        lines = [f"difftest: run seed {self.seed}, {len(self.cases)} cases over {len(self.programs)} programs, "
                 f"{sum(len(r) for r in self.results.values())} runs",
                 f"  entry identities drawn (a sound key's compiles, at most): {self.compile_identities}; gear plans: "
                 f"{self.plan_identities}"]
        for side in self.results:
            t = self.totals(side)
            lines.append(f"  {side:4}: {dict(self.outcomes(side))}; compiles {t.get('compiles', 0)}, loads "
                         f"{t.get('loads', 0)}, traces {t.get('traces', 0)}, pads {t.get('pads', 0)}, eager calls "
                         f"{t.get('eager_calls', 0)}, graph captures {t.get('graph_captures', 0)}")
        lines.append(f"  stale loads: {len(self.stale)} ({sum(s['outcome'] in FAILED for s in self.stale)} of them "
                     f"gave a wrong answer)")
        for side in self.results:
            lines.append(f"  refused ({side}), by reason:")
            lines += [f"    {n:4}  {reason}" for reason, n in self.refusals(side).most_common()]
        if self.cpu_twins:
            lines.append(f"  refused on the GPU, equal to eager on the CPU (same case): {len(self.gpu_only_refusals)} "
                         f"of {len(self.cpu_twins)} GPU refusals")
            lines += [f"    case {g['id']}: {g['gpu'][:200]}" for g in self.gpu_only_refusals]
        lines.append("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items()))
        lines.append("  coverage (feature: equal / refused / failed / upstream):")
        for tag, c in self.coverage().items():
            lines.append(f"    {tag:44} {c['equal']:4} / {c['refused']:4} / {sum(c[k] for k in FAILED):4} / "
                         f"{c[UPSTREAM]:3}")
        for f in self.upstream:
            lines.append(f"  UPSTREAM case {f['id']} ({f['side']}, at {f['call']}): "
                         f"{f['detail'].splitlines()[0][:160]}")
        for f in self.failures:
            where = self.reproducers.get(f"{f['id']}/{f['side']}", "")
            lines.append(f"  FAILED case {f['id']} ({f['side']}, {f['outcome']} at {f['call']}): "
                         f"{f['detail'].splitlines()[0][:160]}" + (f"\n    reproducer: {where}" if where else ""))
        return "\n".join(lines)


_VERBS = ("takes the", "takes a", "reduces over", "reads positions", "writes padding rows", "contracts over",
          "has no padding", "concatenates", "sorts", "works along", "selects", "slices", "reshapes", "squeezes",
          "splits", "uses the size", "combines", "attends", "mixes", "normalises", "indexes", "gathers", "exchanges",
          "reduce-scatters", "draws", "returns", "multiplies", "shifts", "moves", "looks rows up", "scatters", "writes",
          "the traced graph")


def refusal_reason(detail: str) -> str:
    """A refusal's reason without its case's particulars (source lines, sizes): the exception, and for a padding
    refusal the op and why (``PaddingUnsafeError: aten.mean: reduces over a padded dim``)."""
    text = detail.split(": ", 1)[1] if detail.startswith(("call ", "warmup()")) else detail
    exc, _, message = text.partition(": ")
    if exc == "PaddingUnsafeError" and "would change state" in message:
        return f"{exc}: a write through a padded dim into state or an unpadded input"
    if exc == "PaddingUnsafeError":
        found = re.search(r"results: (\S+) at .*?: ((?:" + "|".join(map(re.escape, _VERBS)) + r")[^;]*)", message)
        if found:
            op = re.sub(r"\.(default|dim\w*|Tensor\w*|Scalar\w*|self|int|values)$", "", found.group(1))
            return f"{exc}: {op}: {found.group(2).split(' (')[0]}"
    if exc == "UnsupportedInputError" and "returns tensors only" in message:
        return f"{exc}: a number computed from a tensor or a padded size returned (.item(), x.shape[0])"
    if exc == "PastLargestGearError":
        return f"{exc}: a call past the largest gear (past_largest_gear='error')"
    message = re.sub(r"^\S+\.\w+: ", "", message.split(". ")[0].splitlines()[0])     # the method's name
    return f"{exc}: {re.sub(r'[0-9]+', 'N', message)[:110]}"


def cpu_twin(case: dict) -> dict:
    """A GPU case run on the CPU: the same program, values, gears and calls, with mode "default"."""
    options = {k: v for k, v in case["options"].items()
               if k not in ("mode", "graph_outputs", "capture_graphs", "static_address")}
    return dict(main_case(case), device="cpu", options=dict(options, mode="default"))


def run_cpu_twins(cases: list[dict], results: dict[int, dict], src: Path, store: Path,
                  log: Callable[[str], None]) -> dict[int, dict]:
    """The CPU twin's result of every case ``results`` refused (a GPU run: a refusal must hold on every device)."""
    twins = {}
    for case in cases:
        if results.get(case["id"], {}).get("outcome") == "refused":
            twins[case["id"]] = runner.run_case(cpu_twin(case), src, str(store))
    log(f"difftest: {len(twins)} refused GPU cases run again on the CPU: "
        f"{sum(r['outcome'] == 'equal' for r in twins.values())} equal to eager there")
    return twins


def write_sources(src: Path, progs: list[dict], consts: dict[str, dict] | None = None) -> None:
    """Write every program's files into ``src`` (``consts``: module -> constants, else the defaults)."""
    src.mkdir(parents=True, exist_ok=True)
    for program in progs:
        for name, text in programs.render(program, (consts or {}).get(program["module"])).items():
            path = src / name
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)


def main_case(case: dict) -> dict:
    return {k: v for k, v in case.items() if k not in ("tags", "warm_batch")}


def warm_case(case: dict) -> dict:
    return dict(main_case(case), assign={})


def run_main(cases: list[dict], src: Path, store: Path, log: Callable[[str], None]) -> dict[int, dict]:
    """Run every case in this process, in order."""
    results = {}
    for n, case in enumerate(cases):
        results[case["id"]] = runner.run_case(main_case(case), src, str(store))
        if (n + 1) % 50 == 0:
            log(f"difftest: {n + 1}/{len(cases)} cases run in this process")
    return results


def run_warm_batches(progs: list[dict], cases: list[dict], work: Path, store: Path,
                     log: Callable[[str], None], batch_size: int = 400) -> dict[int, dict]:
    """Run every case again in fresh processes: batch 0 with the program files as they are, batch 1 with every
    constant edited (draw.warm_consts); at most ``batch_size`` cases per process."""
    src = work / "src"
    results: dict[int, dict] = {}
    for batch in (0, 1):
        todo = [c for c in cases if c["warm_batch"] == batch]
        if not todo:
            continue
        write_sources(src, progs, {p["module"]: draw.warm_consts(p, batch) for p in progs})
        try:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start:start + batch_size]
                results.update(_warm_process(chunk, src, store, work / "warm" / f"batch_{batch}_{start}", log))
        finally:
            write_sources(src, progs)                    # this process's files again
    return results


def _warm_process(cases: list[dict], src: Path, store: Path, stem: Path, log: Callable[[str], None]) -> dict:
    stem.parent.mkdir(parents=True, exist_ok=True)
    batch_file, results_file = stem.with_suffix(".json"), Path(f"{stem}_results.json")
    batch_file.write_text(json.dumps({"src": str(src), "cache_dir": str(store),
                                      "cases": [warm_case(c) for c in cases]}))
    proc = subprocess.run([sys.executable, str(TESTS / "scripts" / "difftest_warm.py"), str(batch_file),
                           str(results_file)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"difftest_warm.py failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    log(f"difftest: fresh process: {proc.stdout.strip().splitlines()[-1]}")
    return {r["id"]: r for r in json.loads(results_file.read_text())}


def find_stale(cases: list[dict], results: dict[str, dict[int, dict]]) -> tuple[list[dict], dict[str, tuple]]:
    """Stale loads, and which (case id, side) first used each entry. Sides are taken in the order they ran."""
    first: dict[str, tuple] = {}
    owner: dict[str, str] = {}
    stale = []
    for side, values_of in (("main", draw.main_values), ("warm", draw.warm_values)):
        for case in cases:
            result = results.get(side, {}).get(case["id"])
            if result is None:
                continue
            values = json.dumps(values_of(case), sort_keys=True)
            for ekey in result["entries"]:
                first.setdefault(ekey, (case["id"], side))
                if owner.setdefault(ekey, values) != values:
                    stale.append({"id": case["id"], "side": side, "entry": ekey, "first_used_by": first[ekey],
                                  "outcome": result["outcome"]})
    return stale, first


def run_difftest(seed: int, cases: int, work: Path, *, device: str = "cpu", graphs: bool = False,
                 n_programs: int = 9, max_compiles: int = 48, max_plans: int = 30, warm: bool = True,
                 shrink: int = 2, shrink_seconds: float = 300.0,
                 log: Callable[[str], None] = lambda s: print(s, flush=True)) -> Report:
    """Draw and run a session in the folder ``work``; shrink the first ``shrink`` failures (at most
    ``shrink_seconds`` each) into reproducers under ``work/repro``."""
    t0 = time.perf_counter()
    progs, drawn, ledger = draw.draw_run(seed, cases, device=device, graphs=graphs, n_programs=n_programs,
                                         max_compiles=max_compiles, max_plans=max_plans)
    src, store = work / "src", work / "store"
    write_sources(src, progs)
    seconds = {}
    results = {"main": run_main(drawn, src, store, log)}
    seconds["main"] = time.perf_counter() - t0
    twins = run_cpu_twins(drawn, results["main"], src, work / "store_cpu", log) if device == "cuda" else {}
    if warm:
        t1 = time.perf_counter()
        results["warm"] = run_warm_batches(progs, drawn, work, store, log)
        seconds["warm"] = time.perf_counter() - t1
    stale, first = find_stale(drawn, results)
    report = Report(seed, progs, drawn, results, stale, seconds, len(ledger.identities), len(ledger.plans),
                    cpu_twins=twins)
    if shrink and report.failures:
        from . import shrink as shrinker

        t2 = time.perf_counter()
        report.reproducers = shrinker.shrink_failures(report, first, work, shrink, shrink_seconds, log)
        seconds["shrink"] = time.perf_counter() - t2
    seconds["total"] = time.perf_counter() - t0
    (work / "report.json").write_text(json.dumps(dict(report.to_json(), drawn=drawn), indent=1))
    return report
