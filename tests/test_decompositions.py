"""Custom decompositions (gearcache/keys/decompositions.py): what each computes is its key factor, so a table that
computes something else never loads another's entry; what cannot be keyed is refused at ``cache_compile``; the gear
plan's padding proof reads the graph with them applied."""
import functools
import subprocess
import sys
import textwrap

import pytest
import torch

from gearcache import ConfigError, cache_compile, set_dim_gears
from gearcache.errors import PaddingUnsafeError
from gearcache.keys.decompositions import checked, factor

aten = torch.ops.aten
SCALE = 2.0


def _decomp_a(x):
    return x * 0.5


def _decomp_b(x):
    return x * 0.25


def _scaled(x):
    return x * SCALE


def _through_helper(x):
    return _scaled(x) + 1


def _make(scale):
    def dec(x, approximate="none"):
        return x * scale
    return dec


def _with_default(x, approximate="none", s=2.0):
    return x * s


def _digest(fn, op=aten.silu.default):
    return factor({op: fn})[0][1]


def test_the_factor_is_sorted_by_op_and_follows_the_functions_code():
    assert factor(None) == [] and factor({}) == []
    f = factor({aten.silu.default: _decomp_a, aten.gelu.default: _decomp_a})
    assert [op for op, _ in f] == sorted([str(aten.silu.default), str(aten.gelu.default)])
    assert f[0][1] == f[1][1]
    assert f == factor({aten.gelu.default: _decomp_a, aten.silu.default: _decomp_a})
    assert factor({aten.silu.default: _decomp_b, aten.gelu.default: _decomp_a}) != f


def test_what_a_decomposition_reads_beside_its_source_is_in_the_factor(monkeypatch):
    """Equal source text, other values: closures, defaults, a module constant read through a helper, constants of
    lambdas written on one line, a function without source (exec) - each a factor of its own."""
    assert _digest(_make(2.0)) != _digest(_make(3.0))
    assert _digest(_make(2.0)) == _digest(_make(2.0))
    other_default = functools.partial(_with_default, s=3.0)
    assert _digest(_with_default) != _digest(other_default)
    before = _digest(_through_helper)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 5.0)
    assert _digest(_through_helper) != before
    two, three = (lambda x: x * 2.0), (lambda x: x * 3.0)
    assert _digest(two) != _digest(three)
    made = {}
    for scale in ("2.0", "3.0"):
        exec(f"def dec(x):\n    return x * {scale}\n", made)
        made[scale] = made["dec"]
    assert _digest(made["2.0"]) != _digest(made["3.0"])


class _Stateful:
    def __init__(self, s):
        self.s = s

    def __call__(self, x):
        return x * self.s

    def method(self, x):
        return x * self.s


class _Knob:
    scale = 2.0


KNOB = _Knob()


def _reads_an_object(x):
    return x * KNOB.scale


@pytest.mark.parametrize("fn", [_Stateful(2.0), _Stateful(2.0).method, _reads_an_object],
                         ids=["callable object", "bound method", "global object"])
def test_a_decomposition_that_cannot_be_keyed_is_refused_naming_the_op(tmp_path, fn):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"custom_decompositions\[aten.silu.default\].*Fix"):
        cache_compile(m.forward, cache_dir=tmp_path, custom_decompositions={aten.silu.default: fn})


def test_a_packet_stands_for_its_overloads_and_a_non_op_key_is_refused():
    table = checked({aten.gelu: _decomp_a})
    assert aten.gelu.default in table
    assert all(table[getattr(aten.gelu, name)] is _decomp_a for name in aten.gelu.overloads())
    with pytest.raises(ConfigError, match="not a torch op"):
        checked({"gelu": _decomp_a})
    with pytest.raises(ConfigError, match="not callable"):
        checked({aten.gelu.default: 2.0})


class _Relu(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


def _centred(x):             # reads every row: padding the batch changes the real rows
    return x - x.mean(0, keepdim=True)


def test_the_padding_proof_reads_the_graph_with_the_decompositions_applied(tmp_path):
    """relu is row-wise (proved safe to pad), its decomposition is not: the gear plan is refused, never padded."""
    m = _Relu()
    cf = cache_compile(m.forward, cache_dir=tmp_path, custom_decompositions={aten.relu.default: _centred})
    x = torch.arange(12.).reshape(3, 4)
    set_dim_gears(x, {0: [4, 8]})
    with pytest.raises(PaddingUnsafeError):
        cf(x)


_CLOSURE_PROCESS = textwrap.dedent("""
    import sys, torch
    from gearcache import cache_compile
    scale = float(sys.argv[2])
    def make(s):
        def dec(x):
            return x * s
        return dec
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.silu(x) + 1
    cf = cache_compile(M().forward, cache_dir=sys.argv[1],
                       custom_decompositions={torch.ops.aten.silu.default: make(scale)})
    x = torch.arange(4.0)
    print(cf(x).tolist() == (x * scale + 1).tolist())
""")


@pytest.mark.slow
def test_a_process_whose_closure_differs_is_not_served_the_others_entry(tmp_path):
    for scale in ("2.0", "3.0"):
        out = subprocess.run([sys.executable, "-c", _CLOSURE_PROCESS, str(tmp_path), scale], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines()[-1] == "True", (scale, out.stdout, out.stderr[-2000:])


def _add_doubled(a, b, alpha=1):
    return torch.sub(a, -b * alpha) * 2


class _Accumulates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(3))

    def forward(self, x):
        self.acc.add_(x)
        return x + 1


def test_an_ops_decomposition_also_decomposes_its_in_place_variant(tmp_path):
    """``acc.add_(x)`` computes what ``acc + x`` does under the table (as AOTAutograd's functionalised decomposition
    does); a decomposition whose parameters are not its op's is a ConfigError naming the table."""
    table = checked({aten.add.Tensor: _add_doubled})
    assert aten.add_.Tensor in table
    m = _Accumulates()
    cf = cache_compile(m.forward, cache_dir=tmp_path, custom_decompositions={aten.add.Tensor: _add_doubled})
    with torch.no_grad():
        out = cf(torch.ones(3))
    assert out.tolist() == [4.0, 4.0, 4.0] and m.acc.tolist() == [2.0, 2.0, 2.0]
    wrong = cache_compile(_Relu().forward, cache_dir=tmp_path / "wrong",
                          custom_decompositions={aten.relu.default: lambda x, y: x})
    with pytest.raises(ConfigError, match="custom_decompositions.*parameters"):
        wrong(torch.ones(2))



class _Gelu(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x, approximate="tanh") + 1


def _scaled_by_max(x, approximate="none"):
    return x * x.max().item()


def test_a_decomposition_reading_a_value_with_item_compiles_and_reads_it_per_call(tmp_path):
    """Was Inductor's ``AssertionError ... possible memo disaster``: the retrace's unbacked symbol named twice."""
    cf = cache_compile(_Gelu().forward, cache_dir=tmp_path, custom_decompositions={aten.gelu.default: _scaled_by_max})
    with torch.no_grad():
        for scale in (1.0, 3.0):
            x = torch.arange(6.0).reshape(2, 3) * scale
            assert torch.equal(cf(x), x * x.max() + 1)


class _Config:
    scale = 2.0


def _reads_a_class_attribute(x):
    return x * _Config.scale


def _recursive(x, n=2):
    return x if n == 0 else _recursive(x * 2, n - 1)


LOW = frozenset({torch.float16, torch.bfloat16})


def _reads_a_set(x):
    return x.float() if x.dtype in LOW else x * 2


def test_values_reached_through_classes_numpy_and_helpers_are_in_the_factor_and_stateless_ones_accepted(monkeypatch):
    """Second round of the breaker (helper break54b): a class attribute a decomposition reads, a numpy scalar in its
    closure; a recursive decomposition and a global set are accepted, a global module with weights refused."""
    before = _digest(_reads_a_class_attribute)
    monkeypatch.setattr(_Config, "scale", 3.0)
    assert _digest(_reads_a_class_attribute) != before
    np = pytest.importorskip("numpy")
    assert _digest(_make(np.int64(2))) != _digest(_make(np.int64(3)))
    assert _digest(_recursive) and _digest(_reads_a_set)
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="Linear cannot be keyed"):
        checked({aten.gelu.default: lambda x, approximate="none": lin(x)})


def test_an_in_place_view_op_gets_no_in_place_variant():
    """``squeeze_`` changes a view's metadata: ``self.copy_(squeeze(self))`` would write data instead (shape (1, 6)
    where eager gives (6,)). Only pointwise ops' in-place variants are derived."""
    table = checked({aten.squeeze.dim: lambda x, dim: x.squeeze(dim), aten.add.Tensor: _add_doubled})
    assert aten.squeeze_.dim not in table and aten.add_.Tensor in table


def _pkg_reader(tmp_path, monkeypatch):
    pkg = tmp_path / "gc_dec_pkg" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "gc_dec_pkg" / "__init__.py").write_text("from . import sub\n")
    (pkg / "__init__.py").write_text("SCALE = 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gc_dec_pkg
    made = {"gc_dec_pkg": gc_dec_pkg}
    exec("def dec(x, approximate='none'):\n    return x * gc_dec_pkg.sub.SCALE\n", made)
    return gc_dec_pkg, made["dec"]


def test_values_behind_submodules_torch_decorators_function_attributes_and_names_in_strings(tmp_path, monkeypatch):
    """Third round (helper break54c): ``pkg.sub.SCALE``, a decomposition under ``@torch.no_grad()`` (its wrapper's
    code is torch's, the body is the user's), ``fn.scale`` and ``getattr(cfg, "SCALE")`` are all in the factor."""
    pkg, dec = _pkg_reader(tmp_path, monkeypatch)
    before = _digest(dec)
    monkeypatch.setattr(pkg.sub, "SCALE", 3.0)
    assert _digest(dec) != before

    @torch.no_grad()
    def under_no_grad(x):
        return x * SCALE
    before = _digest(under_no_grad)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 7.0)
    assert _digest(under_no_grad) != before

    def with_attribute(x):
        return x * with_attribute.scale
    with_attribute.scale = 2.0
    before = _digest(with_attribute)
    with_attribute.scale = 3.0
    assert _digest(with_attribute) != before

    def by_string(x):
        return x * getattr(_Config, "scale")  # noqa: B009 - a name read from a string
    before = _digest(by_string)
    monkeypatch.setattr(_Config, "scale", 9.0)
    assert _digest(by_string) != before


def test_a_decomposition_making_a_tensor_constant_is_refused_before_anything_is_stored(tmp_path):
    """``x * torch.tensor(2.0)`` lifts a constant the compiled graph is not given: it crashed at the first call, and
    the entry stayed in the store for every later process."""
    cf = cache_compile(_Gelu().forward, cache_dir=tmp_path,
                       custom_decompositions={aten.gelu.default: lambda x, approximate="none": x * torch.tensor(2.0)})
    with pytest.raises(ConfigError, match="tensor constant"):
        cf(torch.ones(3))
    stored = [f for d in ("entries", "artifacts") for f in (tmp_path / d).rglob("*") if f.is_file()]
    assert stored == [], "nothing is stored for a refused compile"


def test_no_in_place_variant_where_the_parameters_differ():
    """``polygamma(n, self)`` against ``polygamma_(self, n)``: the derived variant would swap them."""
    table = checked({aten.polygamma.default: lambda n, x: x})
    assert aten.polygamma_.default not in table
