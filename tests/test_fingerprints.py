"""gearcache/keys/fingerprints.py: what a class or a function does, as a digest that changes whenever it would run
differently and means the same in every process."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from gearcache.keys import fingerprints


def _factory(scale, offset=1.0):
    def f(x, k=offset):
        return x * scale + k
    return f


class Base(torch.nn.Module):
    def helper(self, x):
        return x + 1

    def forward(self, x):
        return self.helper(x)


class Child(Base):
    @property
    def width(self):
        return 4

    @staticmethod
    def act(x):
        return x.relu()


def test_a_function_digest_covers_code_defaults_and_closure_contents():
    base = fingerprints.function_digest(_factory(2.0))
    assert fingerprints.function_digest(_factory(2.0)) == base, "same code, defaults and closure: same digest"
    assert fingerprints.function_digest(_factory(5.0)) != base, "another closure value"
    assert fingerprints.function_digest(_factory(2.0, offset=3.0)) != base, "another default"
    f = _factory(2.0)
    f.__defaults__ = None
    assert fingerprints.function_digest(f) != base, "defaults removed (the no-defaults patch of issue #35)"

    def other(x, k=1.0):
        return x * 2.0 - k
    assert fingerprints.function_digest(other) != base, "other code"


def test_a_closure_rebound_in_place_changes_the_digest():
    scale = 2.0

    def f(x):
        return x * scale
    before = fingerprints.function_digest(f)
    scale = 5.0                             # noqa: F841 - read through f's closure
    assert fingerprints.function_digest(f) != before


def test_a_class_digest_follows_its_methods_and_its_bases():
    before = fingerprints.class_fp(Child)
    original = Base.helper
    try:
        Base.helper = lambda self, x: x + 34                  # the Liger/Unsloth pattern, on a base class
        assert fingerprints.class_fp(Child) != before
        assert fingerprints.class_fp(Child)[:2] == ["class", f"{__name__}.Child"]
    finally:
        Base.helper = original
    assert fingerprints.class_fp(Child) == before, "restored: the same digest again"


def test_descriptors_count_by_their_functions():
    before = fingerprints.class_digest(Child)
    original = Child.__dict__["width"]
    try:
        Child.width = property(lambda self: 8)
        assert fingerprints.class_digest(Child) != before
    finally:
        Child.width = original
    assert fingerprints.class_digest(Child) == before


def test_runtime_noise_and_dynamos_own_patch_do_not_change_a_digest():
    """A deep copy sets ``__slotnames__`` on the class; Dynamo's first capture wraps ``nn.Module.__init__``: a process
    that did either must compute the digest of one that did neither."""
    class Fresh(torch.nn.Module):
        def forward(self, x):
            return x * 2

    before = fingerprints.class_digest(Fresh)
    copy.deepcopy(Fresh())
    torch.compile(Fresh().forward, backend=lambda gm, ex: gm, fullgraph=True)(torch.ones(2))
    assert fingerprints.class_digest(Fresh) == before


def test_a_class_digest_read_during_a_torch_fx_trace_is_the_one_read_outside():
    """``torch.fx``'s tracer (``make_fx`` under every AOTAutograd compile, in whatever thread compiles) sets wrappers
    of ``nn.Module.__call__`` and ``__getattr__`` on the class while it traces: a module class's digest read meanwhile
    (another thread's guard check) must be the one read outside. Was: it differed, and the guards of a cached method
    naming its module's class failed, dropping its gear plan and entries (a warm-up compiling a gear in a thread of
    its own process: ``test_gears``' overlapping padded views, served unpadded instead of refused, 1 run in 3)."""
    before = fingerprints.class_digest(Child)
    own = torch.nn.Module.__dict__["__call__"]
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((torch.nn.Module.__dict__["__call__"] is not own, fingerprints.class_digest(Child)))
            return x

    torch.fx.symbolic_trace(Probe())
    assert seen == [(True, before)]
    assert fingerprints.class_digest(Child) == before


def test_built_in_classes_are_named_only():
    assert fingerprints.class_fp(dict) == ["class", "builtins.dict"]
    assert fingerprints.class_digest(int) == ""


def test_a_self_recursive_closure_digests_the_same_whatever_was_digested_first():
    def make():
        def fact(n):
            return 1 if n <= 1 else n * fact(n - 1)
        return fact
    a, b = make(), make()
    fingerprints.function_digest(a, 1)                        # another depth first: no effect on the default one
    assert fingerprints.function_digest(a) == fingerprints.function_digest(b)


SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import test_fingerprints as t
    from gearcache.keys import fingerprints
    print(fingerprints.class_fp(t.Child)[2], fingerprints.function_digest(t._factory(2.0)))
""")


def test_digests_are_the_same_in_a_fresh_process():
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(Path(__file__).parent))],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == [fingerprints.class_fp(Child)[2], fingerprints.function_digest(_factory(2.0))]


def test_a_class_digest_follows_its_methods_closures_rebound_in_place():
    """A factory's class whose method reads ``scale``, rebound by ``nonlocal`` after a digest was cached: the class
    is not modified (its version tag stays), its digest must still change."""
    def factory(scale):
        class Scaled(torch.nn.Module):
            def forward(self, x):
                return x * scale

        def set_scale(v):
            nonlocal scale
            scale = v
        return Scaled, set_scale

    cls, set_scale = factory(2.0)
    before = fingerprints.class_digest(cls)
    set_scale(5.0)
    assert fingerprints.class_digest(cls) != before
    assert fingerprints.class_digest(cls) == fingerprints.class_digest(factory(5.0)[0])


@pytest.mark.slow
def test_a_class_fingerprint_does_not_depend_on_whether_transformers_built_a_model_in_the_process():
    """transformers adds ``nn.Module.smart_apply`` the first time a model initialises its weights: a process that had
    built one fingerprinted every module class otherwise and loaded none of the entries a fresh process compiled
    (found by the full suite: an earlier transformers test made later warm loads miss). In a fresh process, the
    fingerprint of a plain module class is the same before and after building a tiny Llama."""
    code = (
        "import json, torch\n"
        "from gearcache.keys.fingerprints import class_fp\n"
        "class Plain(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x\n"
        "before = class_fp(Plain)\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "                             num_attention_heads=2, num_key_value_heads=2, vocab_size=32))\n"
        "print(json.dumps([before == class_fp(Plain), 'smart_apply' in torch.nn.Module.__dict__]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    same, patched = json.loads(out.stdout.strip().splitlines()[-1])
    assert patched, "transformers no longer adds smart_apply: the case this test guards is gone"
    assert same
