"""Reproducer scripts: a failure's scenario as one standalone Python file (needs only torch and gearcache).

A **scenario** (JSON-able) is what a failure needs to happen again on a fresh store::

    {"programs": [program spec, ...],
     "processes": [{"consts": {module: {name: value}}, "cases": [case, ...]}, ...],
     "target": [process index, case index],
     "expect": {"outcome": "mismatch", "family": "output"},
     "title": "...", "detail": "the failure as the session saw it"}

Each process is a fresh Python process that first writes the program files with its constants (an edit between
the compiling and the loading process), then runs its cases in order against one store. The script embeds the
program files, the cases and ``runner.py`` itself; run it with ``python3 script.py``: it prints each case's outcome
and exits 1 when the target case fails again (0 when it equals eager or is refused).
"""
import ast
import pprint
from pathlib import Path

from . import programs

RUNNER = Path(__file__).with_name("runner.py")

MAIN = '''

# ------------------------------------------------------------------------------------------------ the reproducer
def _describe(case):
    o = case["options"]
    gears = o.get("gears") or {}
    return (f"attrs={case.get('attrs')} assign={case.get('assign')} route={o.get('route')} "
            f"gears={gears.get('sizes')}/{gears.get('policy')}/{gears.get('declare')} "
            f"calls={[c['B'] for c in case['calls']]}")


def reproduce():
    import json
    import subprocess
    import tempfile

    if len(sys.argv) == 5 and sys.argv[1] == "--process":
        k, src, store = int(sys.argv[2]), sys.argv[3], sys.argv[4]
        print("DIFFTEST-RESULTS " + json.dumps([run_case(case, src, store) for case in CASES[k]]))
        return 0
    work = Path(tempfile.mkdtemp(prefix="difftest-repro-"))
    src, store = work / "src", work / "store"
    src.mkdir()
    target = None
    for k, files in enumerate(SOURCES):
        for name, text in files.items():
            (src / name).write_text(text)
        proc = subprocess.run([sys.executable, __file__, "--process", str(k), str(src), str(store)],
                              capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("DIFFTEST-RESULTS ")]
        if proc.returncode or not lines:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 2
        for j, (case, result) in enumerate(zip(CASES[k], json.loads(lines[-1].split(" ", 1)[1]))):
            print(f"process {k}, case {j}: {_describe(case)}\\n  -> {result['outcome']} {result['detail']}")
            if [k, j] == TARGET:
                target = result
    print(f"expected: every case equals eager or raises a gearcache error; the target (process {TARGET[0]}, case "
          f"{TARGET[1]}) gave {target['outcome']}. Work folder: {work}")
    if "--json" in sys.argv:
        print("DIFFTEST-TARGET " + json.dumps(target))
    return 1 if target["outcome"] in ("mismatch", "crash", "invalid") else 0


if __name__ == "__main__":
    sys.exit(reproduce())
'''


def render_script(scenario: dict) -> str:
    """The reproducer of ``scenario`` as the text of a Python script."""
    sources = [_sources(scenario["programs"], p["consts"]) for p in scenario["processes"]]
    cases = [p["cases"] for p in scenario["processes"]]
    k, j = scenario["target"]
    header = ['"""gearcache differential-test reproducer: ' + scenario["title"].replace('"""', "'''"), "",
              "What the session saw (process %d, case %d):" % (k, j)]
    header += ["    " + line for line in scenario["detail"].replace('"""', "'''").splitlines()[:8]]
    header += ["", "Run: python3 this_file.py (torch and gearcache importable). Each process is a fresh Python process "
               "that writes", "SOURCES[k] into one folder, then runs CASES[k] against one store (run_case below: "
               "the model and its eager twin", "call by call). Exit 1: the target case failed again.", '"""',
               "import sys", "from pathlib import Path", ""]
    body = ["# ---- the program files as each process writes them (constants may differ: an edit between processes)",
            "SOURCES = [" + ",\n".join(_files_literal(files) for files in sources) + "]", "",
            "# ---- the cases each process runs, in order", f"CASES = {pprint.pformat(cases, width=116)}",
            f"TARGET = {[k, j]}", "", "# ---- tests/difftest/runner.py, as it is", _runner_code()]
    return "\n".join(header + body) + MAIN


def _sources(progs: list[dict], consts: dict) -> dict[str, str]:
    files: dict[str, str] = {}
    for program in progs:
        files.update(programs.render(program, consts.get(program["module"])))
    return files


def _files_literal(files: dict[str, str]) -> str:
    items = []
    for name, text in files.items():
        literal = f"'''{text}'''" if "'''" not in text and "\\" not in text and not text.endswith("'") else repr(text)
        items.append(f"    {name!r}: {literal}")
    return "{\n" + ",\n".join(items) + "}"


def _runner_code() -> str:
    """runner.py without its module docstring (the reproducer has its own)."""
    text = RUNNER.read_text()
    tree = ast.parse(text)
    first = tree.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        text = "\n".join(text.splitlines()[first.end_lineno:])
    return text.strip("\n")
