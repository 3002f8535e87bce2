"""Shrink a failure into a small scenario and write its reproducer (see repro.py for scenarios).

The first scenario is the failing case plus the cases that first used (compiled) the entries it used, in the
processes they ran in; if that does not fail again, every earlier case of its program. Then, greedily, while the
target case still fails *the same way* (same outcome, same place: "output", "input state", "module.seen", ...):
drop other cases, merge the processes, drop calls, drop program blocks (and the values and inputs they bring),
make the output plain, reset options to their defaults and values to the program's defaults. Each candidate runs on
a fresh store: process 0 in this process (its modules renamed, so nothing of the session is reused), later
processes through ``tests/scripts/difftest_warm.py``. The reproducer written at the end is then run as a script, a
fresh process per scenario process, to check that it fails on its own.
"""
import copy
import itertools
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from . import draw, programs, repro, runner, session

_counter = itertools.count()


# ---------------------------------------------------------------------------------------------- evaluation
def family(result: dict) -> str:
    """Where a failure shows: the first difference's place without indices, or the exception's type."""
    first = result["detail"].splitlines()[0] if result["detail"] else ""
    if result["outcome"] == "crash":
        return first.split(":")[1].strip() if ":" in first else first
    return re.sub(r"\[.*?\]", "", first.split(":")[0]).strip()


def still_fails(scenario: dict, work: Path) -> bool:
    result = evaluate(scenario, work)
    return result is not None and result["outcome"] == scenario["expect"]["outcome"] and \
        family(result) == scenario["expect"]["family"]


def evaluate(scenario: dict, work: Path) -> dict | None:
    """The target case's result when ``scenario`` runs on a fresh store (None if a process could not run)."""
    renamed = _renamed(scenario, f"_s{next(_counter)}")
    folder = work / f"attempt_{next(_counter)}"
    src, store = folder / "src", folder / "store"
    k_target, j_target = renamed["target"]
    for k, proc in enumerate(renamed["processes"]):
        session.write_sources(src, renamed["programs"], proc["consts"])
        if k == 0:
            results = [runner.run_case(case, src, str(store)) for case in proc["cases"]]
        else:
            try:
                got = session._warm_process([dict(c, id=j) for j, c in enumerate(proc["cases"])], src, store,
                                            folder / f"process_{k}", lambda s: None)
            except (RuntimeError, subprocess.TimeoutExpired):
                return None
            results = [got[j] for j in range(len(proc["cases"]))]
        if k == k_target:
            return results[j_target]
    return None


def _renamed(scenario: dict, suffix: str) -> dict:
    """``scenario`` with every program module (and helper) renamed: in-process attempts never reuse modules."""
    s = copy.deepcopy(scenario)
    names = {}
    for p in s["programs"]:
        names[p["module"]] = p["module"] + suffix
        p["module"], p["helper"] = p["module"] + suffix, p["helper"] + suffix
    for proc in s["processes"]:
        proc["consts"] = {names[m]: c for m, c in proc["consts"].items()}
        for case in proc["cases"]:
            case["program"] = dict(case["program"], module=names[case["program"]["module"]],
                                   helper=case["program"]["helper"] + suffix)
    return s


# ---------------------------------------------------------------------------------------------- scenarios
def initial_scenarios(report: "session.Report", failure: dict, first: dict[str, tuple]) -> Iterator[dict]:
    """The failing case with the cases that compiled its entries; then with every earlier case of its program."""
    cases = {c["id"]: c for c in report.cases}
    target = cases[failure["id"]]
    result = report.results[failure["side"]][failure["id"]]
    order = [(c["id"], side) for side in ("main", "warm") for c in report.cases]
    creators = {first[e] for e in result["entries"] if first.get(e) not in (None, (failure["id"], failure["side"]))}
    earlier = {(i, side) for i, side in order[:order.index((failure["id"], failure["side"]))]
               if cases[i]["program"]["module"] == target["program"]["module"]}
    for history in (creators, earlier):
        runs = [r for r in order if r in history] + [(failure["id"], failure["side"])]
        yield _scenario(report, runs, target, failure)


def _scenario(report: "session.Report", runs: list[tuple], target: dict, failure: dict) -> dict:
    cases = {c["id"]: c for c in report.cases}
    program = next(p for p in report.programs if p["module"] == target["program"]["module"])
    sides = sorted({side for _, side in runs}, key=["main", "warm"].index)
    processes = []
    for side in sides:
        consts = {} if side == "main" else {program["module"]: draw.warm_consts(program, target["warm_batch"])}
        make = session.main_case if side == "main" else session.warm_case
        processes.append({"consts": consts, "cases": [dict(make(cases[i]), oracle=False)
                                                       for i, s in runs if s == side]})
    last = processes[-1]["cases"][-1]
    if isinstance(failure["call"], int) and failure["call"] >= 0:
        last["calls"] = last["calls"][:failure["call"] + 1]
    return {"programs": [program], "processes": processes,
            "target": [len(processes) - 1, len(processes[-1]["cases"]) - 1],
            "expect": {"outcome": failure["outcome"], "family": family(failure)},
            "title": f"run seed {report.seed}, case {failure['id']} ({failure['side']} side): {failure['outcome']}",
            "detail": failure["detail"]}


# ---------------------------------------------------------------------------------------------- moves
def candidates(s: dict) -> Iterator[dict]:
    """Smaller scenarios than ``s``, roughly the biggest cuts first."""
    yield from _drop_cases(s)
    yield from _merge_processes(s)
    yield from _drop_calls(s)
    yield from _drop_blocks(s)
    yield from _simplify_options(s)
    yield from _default_values(s)


def _drop_cases(s: dict) -> Iterator[dict]:
    kt, jt = s["target"]
    for k, proc in enumerate(s["processes"]):
        for j in range(len(proc["cases"])):
            if (k, j) == (kt, jt):
                continue
            c = copy.deepcopy(s)
            del c["processes"][k]["cases"][j]
            c["target"] = [kt, jt - (k == kt and j < jt)]
            if not c["processes"][k]["cases"] and k != kt:
                del c["processes"][k]
                c["target"][0] -= k < kt
            yield c


def _merge_processes(s: dict) -> Iterator[dict]:
    if len(s["processes"]) == 2:
        c = copy.deepcopy(s)
        first, second = c["processes"]
        c["processes"] = [{"consts": second["consts"], "cases": first["cases"] + second["cases"]}]
        c["target"] = [0, len(first["cases"]) + s["target"][1]]
        yield c


def _drop_calls(s: dict) -> Iterator[dict]:
    for k, proc in enumerate(s["processes"]):
        for j, case in enumerate(proc["cases"]):
            for m in range(len(case["calls"])):
                if len(case["calls"]) > 1:
                    c = copy.deepcopy(s)
                    del c["processes"][k]["cases"][j]["calls"][m]
                    yield c


def _drop_blocks(s: dict) -> Iterator[dict]:
    program = s["programs"][0]
    for block in program["blocks"]:
        yield _with_program(s, dict(program, blocks=[b for b in program["blocks"] if b != block]))
    if program["output"] != "plain":
        yield _with_program(s, dict(program, output="plain"))


def _with_program(s: dict, program: dict) -> dict:
    """``s`` with ``program``: its output made plain if it needs a dropped block; values and inputs it lost gone."""
    if not all(req in program["blocks"] for req in programs.OUTPUTS[program["output"]][1]):
        program["output"] = "plain"
    c = copy.deepcopy(s)
    c["programs"] = [program]
    attrs, consts, inputs = programs.attrs_of(program), programs.consts_of(program), programs.inputs_of(program)
    for proc in c["processes"]:
        proc["consts"] = {m: {k: v for k, v in cs.items() if k in consts} for m, cs in proc["consts"].items()}
        for case in proc["cases"]:
            case["program"] = dict(program, inputs=inputs)
            case["attrs"] = {k: v for k, v in case["attrs"].items() if k in attrs}
            case["assign"] = {k: v for k, v in case["assign"].items() if k in consts}
            case["calls"] = [{k: v for k, v in call.items() if k not in ("alpha", "n") or k in inputs}
                             for call in case["calls"]]
            case["mask"] = case["mask"] and "mask" in inputs
    return c


DEFAULT_OPTIONS = {"gears": None, "past_largest": "error", "dynamic": True, "decompositions": None, "warmup": False,
                   "verify_padding": False, "route": "cache_compile"}
DEFAULT_GEARS = {"policy": "zip", "declare": "marks", "pad": 0.0}


def _simplify_options(s: dict) -> Iterator[dict]:
    for k, proc in enumerate(s["processes"]):
        for j, case in enumerate(proc["cases"]):
            for edit in _option_edits(case):
                c = copy.deepcopy(s)
                edit(c["processes"][k]["cases"][j])
                yield c


def _option_edits(case: dict) -> Iterator[Callable[[dict], None]]:
    o = case["options"]
    for name, default in DEFAULT_OPTIONS.items():
        if o.get(name, default) != default:
            yield lambda c, n=name, d=default: c["options"].update({n: d})
    for name, default in DEFAULT_GEARS.items():
        if o.get("gears") and o["gears"][name] != default:
            yield lambda c, n=name, d=default: c["options"]["gears"].update({n: d})
    if case.get("mask"):
        yield lambda c: c.update(mask=False)
    for m, call in enumerate(case["calls"]):
        if call.get("noncontig"):
            yield lambda c, m=m: c["calls"][m].update(noncontig=[])


def _default_values(s: dict) -> Iterator[dict]:
    for k, proc in enumerate(s["processes"]):
        for j, case in enumerate(proc["cases"]):
            for field in ("attrs", "assign"):
                for name in case[field]:
                    c = copy.deepcopy(s)
                    del c["processes"][k]["cases"][j][field][name]
                    yield c
        for module, consts in proc["consts"].items():
            for name in consts:
                c = copy.deepcopy(s)
                del c["processes"][k]["consts"][module][name]
                yield c


# ---------------------------------------------------------------------------------------------- driver
def shrink(scenario: dict, work: Path, deadline: float) -> tuple[dict, int]:
    """Greedy shrinking until no candidate fails the same way, or ``deadline`` (time.monotonic) passes. Returns the
    smallest failing scenario and how many candidates ran."""
    tried = 0
    progress = True
    while progress and time.monotonic() < deadline:
        progress = False
        for candidate in candidates(scenario):
            if time.monotonic() >= deadline:
                break
            tried += 1
            if still_fails(candidate, work):
                scenario, progress = candidate, True
                break
    return scenario, tried


def shrink_failures(report: "session.Report", first: dict[str, tuple], work: Path, limit: int, seconds: float,
                    log: Callable[[str], None]) -> dict[str, str]:
    """Shrink up to ``limit`` failures (one per program, side, stale load or not, outcome and place) and write their
    reproducers into ``work/repro``; returns ``{"<case id>/<side>": script path}``."""
    out, seen = {}, set()
    folder, attempts = work / "repro", work / "shrink"
    folder.mkdir(parents=True, exist_ok=True)
    stale = {(s["id"], s["side"]) for s in report.stale}
    for failure in report.failures:
        case = next(c for c in report.cases if c["id"] == failure["id"])
        kind = (case["program"]["module"], failure["side"], (failure["id"], failure["side"]) in stale,
                failure["outcome"], family(failure))
        if kind in seen or len(seen) >= limit:
            continue
        seen.add(kind)
        deadline = time.monotonic() + seconds
        scenario = next((s for s in initial_scenarios(report, failure, first) if still_fails(s, attempts)), None)
        if scenario is None:
            log(f"difftest: case {failure['id']} ({failure['side']}) does not fail again on a fresh store with its "
                f"history: not shrunk")
            continue
        scenario, tried = shrink(scenario, attempts, deadline)
        path = folder / f"case_{failure['id']}_{failure['side']}.py"
        path.write_text(repro.render_script(scenario))
        again = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=900)
        log(f"difftest: case {failure['id']} ({failure['side']}) shrunk in {tried} tries to "
            f"{sum(len(p['cases']) for p in scenario['processes'])} case(s) in {len(scenario['processes'])} "
            f"process(es), blocks {scenario['programs'][0]['blocks']}; reproducer {path} "
            f"{'fails again (exit 1)' if again.returncode == 1 else f'exit {again.returncode}: check it by hand'}")
        out[f"{failure['id']}/{failure['side']}"] = str(path)
    return out
