"""The code's shape, checked: no import circles, short functions, no private names across packages, torch privates
only in the adapter, every exception in errors.py (issue #29's "done when").

These read the source with :mod:`ast`; they import nothing from gearcache, so they run in a second.
"""
from __future__ import annotations

import ast
import collections
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent / "gearcache"
MAX_FUNCTION_LINES = 60
ADAPTER_PACKAGE = "gearcache._torch"      # the one package whose modules may name torch's private symbols


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
ADAPTER_MODULES = {m for m in MODULES if m == ADAPTER_PACKAGE or m.startswith(ADAPTER_PACKAGE + ".")}
# underscore modules every gearcache module uses: the torch adapter's and the C call path
PRIVATE_MODULES = ADAPTER_MODULES | {"gearcache.call._callpath"}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _package_of(module: str) -> str:
    """The package a module belongs to: ``gearcache.store.files`` -> ``gearcache.store``."""
    path = MODULES[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _unit_of(module: str) -> str:
    """What may share private names: a subpackage (``gearcache.store``), or a module of the top package alone (the
    top package's modules are separate jobs; the underscore modules are gearcache's own adapters, public inside it)."""
    package = _package_of(module)
    return module if package == "gearcache" and module not in PRIVATE_MODULES else package


def _imported(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """(imported module, imported name or None) for every gearcache import of ``module``."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            target = _imported(module, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    yield f"{target}.{alias.name}", None
                elif target.startswith("gearcache"):
                    yield target, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("gearcache"):
                    yield alias.name, None


def _cycles() -> list[list[str]]:
    """Strongly connected components (more than one module) of the import graph, by Tarjan's algorithm."""
    graph = {m: {t for t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return components


def find_no_import_circles() -> list:
    return _cycles()



def test_no_import_circles():
    assert find_no_import_circles() == []

def find_no_function_is_longer_than_60_lines() -> list:
    long = [f"{m}.{n.name}: {n.end_lineno - n.lineno + 1} lines" for m, tree in TREES.items() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    return long



def test_no_function_is_longer_than_60_lines():
    assert find_no_function_is_longer_than_60_lines() == []


MAX_MODULE_LINES = 500


def test_no_module_is_longer_than_500_lines():
    """Issue #37: a file a newcomer reads in one sitting (the C per-call path, gearcache/call/_callpath.c, aside)."""
    native = {p.relative_to(ROOT).as_posix(): p for p in ROOT.rglob("*") if p.suffix in (".c", ".cpp", ".h")
              and p.name != "_callpath.c"}
    files = {**MODULES, **native}
    long = {name: n for name, path in files.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert native and long == {}

def find_no_module_imports_a_private_name_from_another_package() -> list:
    found = [f"{m} imports {t}.{name}" for m in MODULES for t, name in _imports(m)
             if name and name.startswith("_") and not name.startswith("__") and t in MODULES
             and _unit_of(t) != _unit_of(m) and t not in PRIVATE_MODULES]
    return found


def _names_defined(tree: ast.Module) -> set[str]:
    """Every name a module binds: top-level names, function and class names, attributes it assigns on any object."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _package_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = collections.defaultdict(set)
    for m, tree in TREES.items():
        names[_unit_of(m)] |= _names_defined(tree)
    return names



def test_no_module_imports_a_private_name_from_another_package():
    assert find_no_module_imports_a_private_name_from_another_package() == []

# A named tuple's public API (underscored so as not to clash with its field names: collections.namedtuple's docs)
NAMEDTUPLE_API = {"_fields", "_make", "_asdict", "_replace", "_field_defaults"}


def find_no_module_reads_private_members_of_another_packages_objects() -> list:
    """``obj._member`` (obj not ``self``/``cls``) only where the member is defined in the same unit (see
    ``_unit_of``)."""
    package_names = _package_names()
    found = []
    for m, tree in TREES.items():
        if m in ADAPTER_MODULES:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in package_names[_unit_of(m)] or node.attr in NAMEDTUPLE_API:
                continue
            found.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
    return found


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_torch_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])



def test_no_module_reads_private_members_of_another_packages_objects():
    assert find_no_module_reads_private_members_of_another_packages_objects() == []

def find_torch_private_symbols_are_named_only_in_the_adapter() -> list:
    found = []
    for m, tree in TREES.items():
        if m in ADAPTER_MODULES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and _is_torch_private(node.module or ""):
                found.append(f"{m}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                found += [f"{m}:{node.lineno}: import {a.name}" for a in node.names if _is_torch_private(a.name)]
            elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
                dotted = _dotted(node)
                if dotted and _is_torch_private(dotted):
                    found.append(f"{m}:{node.lineno}: {dotted}")
    return sorted(set(found))



def test_torch_private_symbols_are_named_only_in_the_adapter():
    assert find_torch_private_symbols_are_named_only_in_the_adapter() == []

def find_every_exception_class_lives_in_errors() -> list:
    found = []
    for m, tree in TREES.items():
        if m == "gearcache.errors":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(_dotted(b) and (_dotted(b).endswith(("Error", "Exception"))
                                                                      or _dotted(b) in ERROR_NAMES)
                                                      for b in node.bases):
                found.append(f"{m}.{node.name}")
    return found



def test_every_exception_class_lives_in_errors():
    assert find_every_exception_class_lives_in_errors() == []

ERROR_NAMES = {n.name for n in ast.walk(TREES["gearcache.errors"]) if isinstance(n, ast.ClassDef)}


def _link_parents() -> None:
    """Link every node to its parent, so a dotted chain is reported once (at its outermost attribute)."""
    for tree in TREES.values():
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node


_link_parents()

if __name__ == "__main__":      # python3 tests/test_structure.py: every finding, by check
    for check in [f for name, f in sorted(globals().items()) if name.startswith("find_")]:
        findings = check()
        print(f"{check.__name__}: {len(findings)}")
        for finding in findings:
            print("   ", finding)
