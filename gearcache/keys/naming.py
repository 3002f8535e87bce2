"""The names gearcache gives Python objects, the same however the program is run (``python pkg/mod.py``,
``python -m pkg.mod``, or imported by ``gearcache warmup pkg.mod:make``): entry folders and value guards use them."""
from __future__ import annotations

import os
import sys


def importable_module(name: str) -> str:
    """The name a module is imported by. For the script run as ``__main__``: ``__main__.__spec__.name`` under
    ``python -m pkg.mod``; else, from its file, its stem with every enclosing folder that holds an ``__init__.py``
    (``python pkg/mod.py`` -> ``pkg.mod``), so ``gearcache warmup pkg.mod:make`` warms the entries it loads.
    ``__main__`` where there is no file (``python -c``, a notebook)."""
    if name != "__main__":
        return name
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        spec_name: str = spec.name
        return spec_name
    path = getattr(main, "__file__", None)
    if not path:
        return name
    folder, file = os.path.split(os.path.abspath(path))
    parts = [os.path.splitext(file)[0]]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, package = os.path.split(folder)
        parts.insert(0, package)
    return ".".join(parts)
