"""A differential tester for gearcache: generated small programs compared with an eager twin, call by call.

Modules, one job each:

* ``programs.py``: the grammar: ``nn.Module`` classes written as source files from a JSON spec (blocks of ops,
  attributes, module and helper-file constants, inputs, outputs);
* ``draw.py``: a seeded run: programs, then cases (values, options, calls) within a compile budget;
* ``runner.py``: one case against its eager twin (self-contained: reproducers embed it);
* ``session.py``: a whole run: this process, then fresh processes (``tests/scripts/difftest_warm.py``), stale loads,
  the report (counts and coverage);
* ``shrink.py`` and ``repro.py``: a failure made small, and written as a standalone script;
* ``__main__.py``: ``python3 -m tests.difftest`` (the GPU long mode, longer CPU runs).

CI runs a slice in ``tests/test_difftest.py``; docs/RELIABILITY.md ("Differential tester") says what is generated.
"""
