"""Capture: a graph break is an error that lists every break with its user source line and the fixes."""
import dataclasses

import pytest
import torch

import gearcache


class Breaks(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        y = x * 2
        if y.sum().item() > 0:          # data-dependent Python branch: a graph break
            y = y + 1
        return y


def test_graph_break_lists_reason_line_and_fixes(tmp_path):
    with pytest.raises(gearcache.GraphBreakError) as info:
        with torch.no_grad():
            Breaks(tmp_path).cached(torch.ones(3))
    err = info.value
    assert err.breaks, "at least one break is reported"
    text = str(err)
    assert "test_capture.py" in text and "item()" in text       # the user's source line
    assert "torch.where" in text and ".item()" in text           # how to fix the common ones
    artifacts = tmp_path / "artifacts"
    assert not artifacts.exists() or not any(artifacts.iterdir()), "nothing is published for an uncapturable method"


class Linear(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        return self.lin(x) * 2


def test_none_where_a_tensor_goes_is_the_type_error_eager_raises_not_a_graph_break(tmp_path):
    """An op given the wrong type (None for a tensor) fails while torch traces it, which Dynamo reports as a graph
    break: gearcache raises the op's TypeError, as the method does uncompiled."""
    m = Linear(tmp_path)
    with torch.inference_mode():
        with pytest.raises(TypeError) as eager:
            m.fwd(None)
        with pytest.raises(TypeError, match="Linear.fwd") as cached:
            m.cached(None)
        assert str(eager.value) in str(cached.value)
        torch.testing.assert_close(m.cached(torch.ones(2, 4)), m.fwd(torch.ones(2, 4)))     # then served as usual



class TwoInputs(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, y):
        return self.lin(x) + self.lin(y)


@pytest.fixture(scope="module")
def two_inputs_store(tmp_path_factory):
    """One store for the two TwoInputs tests below: the gear-4 entry (x and y marked) the first compiles, the second
    loads once its ``y`` is marked (its refused call, ``y`` unmarked, is traced either way)."""
    return tmp_path_factory.mktemp("two_inputs")


def test_none_where_a_tensor_goes_beside_a_geared_tensor_is_the_type_error_eager_raises(two_inputs_store):
    """The same through the gear plan's symbolic trace (a marked tensor beside the None), at a call and at warmup()."""
    m = TwoInputs(two_inputs_store)
    x = torch.ones(3, 4)
    gearcache.set_dim_gears(x, {0: [2, 4]})
    with torch.inference_mode():
        with pytest.raises(TypeError) as eager:
            m.fwd(x, None)
        for run in (m.cached, m.cached.warmup):
            with pytest.raises(TypeError, match="TwoInputs.fwd") as cached:
                run(x, None)
            assert str(eager.value) in str(cached.value)
        y = torch.randn(3, 4)
        gearcache.set_dim_gears(y, {0: [2, 4]})
        torch.testing.assert_close(m.cached(x, y), m.fwd(x, y))         # then served as usual, padded to gear 4


def test_a_dim_that_must_equal_a_marked_one_but_is_not_marked_is_refused_naming_the_fix(two_inputs_store):
    """Eager runs the call at its own sizes; padded, ``x`` (marked) and ``y`` (not) no longer add up. A ConfigError
    naming the op's error and the fix, not Dynamo's report; once ``y`` is marked too, the call is served as eager."""
    m = TwoInputs(two_inputs_store)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gearcache.set_dim_gears(x, {0: [2, 4]})
    with torch.inference_mode():
        expected = m.fwd(x, y)
        with pytest.raises(gearcache.ConfigError, match=r"must match the size.*Fix: mark every tensor dim"):
            m.cached(x, y)
        gearcache.set_dim_gears(y, {0: [2, 4]})
        torch.testing.assert_close(m.cached(x, y), expected)

def test_method_returning_nested_structures_round_trips(tmp_path):
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.cached = gearcache.cache_compile(self.fwd, cache_dir=tmp_path)

        def fwd(self, x, extra, scale=2):
            return {"y": x * self.w * scale, "pair": (extra[0] + 1, extra[1]), "n": 7, "w": self.w}

    m = Nested()
    x, a, b = torch.randn(3), torch.randn(3), torch.randn(3)
    with torch.no_grad():
        out = m.cached(x, [a, b], scale=3)
        ref = m.fwd(x, [a, b], scale=3)
    assert list(out) == ["y", "pair", "n", "w"]
    torch.testing.assert_close(out["y"], ref["y"])
    torch.testing.assert_close(out["pair"][0], ref["pair"][0])
    assert out["pair"][1] is b and out["w"] is m.w and out["n"] == 7


class Returns(torch.nn.Module):
    """Returns what ``kind`` names: Python numbers computed from tensors (unservable) or constants (served)."""

    def __init__(self, cache_dir, kind):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kind = kind
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        y = self.lin(x)
        if self.kind == "float":
            return y, float(y.sum())
        if self.kind == "item":
            return {"logits": y, "score": [y.mean().item()]}
        if self.kind == "int":
            return y.argmax().item()
        if self.kind == "none":                 # computes, keeps nothing: the graph has no output
            return None
        if self.kind == "constants":            # no tensor work at all
            return 3.5, None, "tag"
        return y, None, 7


@pytest.mark.parametrize("kind, path, type_name", [("float", "output[1]", "float"),
                                                   ("item", "output['score'][0]", "float"),
                                                   ("int", "output", "int")])
def test_a_python_number_computed_from_a_tensor_is_a_clear_error(tmp_path, kind, path, type_name):
    with torch.no_grad(), pytest.raises(gearcache.UnsupportedInputError) as info:
        Returns(tmp_path, kind).cached(torch.randn(2, 4))
    text = str(info.value)
    assert f"{path} is a Python {type_name} computed from a tensor" in text, text
    assert "Fix: return the 0-d tensor" in text and ".item()" in text
    artifacts = tmp_path / "artifacts"
    assert not artifacts.exists() or not any(artifacts.iterdir()), "nothing is compiled for it"


GLOBAL_TENSOR = torch.full((4,), 2.0)
DEFAULT_BIAS = torch.ones(4)


class ReadsForeignTensors(torch.nn.Module):
    """Reads a tensor that is neither an argument nor a parameter or buffer: a plain attribute, a global, or the
    tensor default of a parameter the call does not pass."""

    def __init__(self, cache_dir, kind):
        super().__init__()
        self.kind = kind
        self.plain = torch.full((4,), 3.0)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, bias=DEFAULT_BIAS):
        if self.kind == "attribute":
            return x * self.plain
        return x * GLOBAL_TENSOR if self.kind == "global" else x + bias


@pytest.mark.parametrize("kind, named", [("attribute", "self.plain, a plain attribute"),
                                         ("global", "GLOBAL_TENSOR, a global"),
                                         ("default", "bias, the default of a parameter the call does not pass")])
def test_a_tensor_read_from_outside_the_arguments_and_the_module_state_is_refused_naming_where_it_is_read(
        tmp_path, kind, named):
    """The refusal said only "graph input 1 (Tensor[4]) is neither an argument nor a parameter or buffer", and told a
    method reading a tensor default to register a buffer: it names the method and where the tensor is read from."""
    with torch.no_grad(), pytest.raises(gearcache.UnsupportedInputError) as info:
        ReadsForeignTensors(tmp_path, kind).cached(torch.randn(2, 4))
    text = str(info.value)
    assert "ReadsForeignTensors.fwd" in text and f"({named})" in text, text
    assert "Fix: " in text


class DataDependent(torch.nn.Module):
    def __init__(self, cache_dir, kind):
        super().__init__()
        self.kind = kind
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        if self.kind == "output":
            return x[x > 0]
        return x[x > 0].sum() + x.sum()


@pytest.mark.parametrize("kind, geared", [("output", False), ("inside", False), ("output", True)])
def test_a_shape_that_depends_on_tensor_values_is_a_graph_break_naming_the_line_and_the_fix(tmp_path, kind, geared):
    """Boolean-mask indexing (nonzero, unique, ...) makes a size from the values: Dynamo captures it, then the capture
    failed with torch's "SymIntArrayRef expected to contain only concrete integers" (returned) or Inductor's
    "u0 possible memo disaster" (inside), retraced and recompiled at every call; with gears, Dynamo's
    BackendCompilerFailed. It is refused at the capture (the gear plan's trace too), naming the op, the user's line
    and the fix; nothing is compiled."""
    x = torch.randn(3, 5)
    with torch.no_grad(), pytest.raises(gearcache.GraphBreakError) as info:
        DataDependent(tmp_path, kind).cached(gearcache.set_dim_gears(x, {0: [4]}) if geared else x)
    text = str(info.value)
    assert "depends on the values" in text and "test_capture.py" in text and "x[x > 0]" in text, text
    assert "Fix: " in text and "torch.where" in text
    artifacts = tmp_path / "artifacts"
    assert not artifacts.exists() or not any(artifacts.iterdir()), "nothing is compiled for it"


@pytest.mark.parametrize("kind, want", [("none", None), ("constants", (3.5, None, "tag"))])
def test_none_and_constant_returns_are_served_and_load_in_another_object(tmp_path, kind, want):
    x = torch.randn(2, 4)
    with torch.no_grad():
        with gearcache.counters.expect(compiles=1, traces=1):
            assert Returns(tmp_path, kind).cached(x) == want
        with gearcache.counters.expect(compiles=0, traces=0, loads=1):
            assert Returns(tmp_path, kind).cached(x) == want


class BumpsBuffer(torch.nn.Module):
    """Writes its buffer, then reads its argument: eager sees the write through an argument that is the buffer."""

    def __init__(self, cache_dir):
        super().__init__()
        self.register_buffer("buf", torch.arange(8.).reshape(2, 4))
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        self.buf.add_(1)
        return torch.nn.functional.linear(x, torch.eye(4) * 3)


@pytest.fixture(scope="module")
def bumps_store(tmp_path_factory):
    """One store for both cases below: the entry the first compiles for ``x`` serves the second (a load)."""
    return tmp_path_factory.mktemp("bumps_buffer")


@pytest.mark.parametrize("view", [False, True], ids=["the-buffer", "a-view-of-it"])
def test_an_argument_sharing_memory_with_a_buffer_is_refused_at_capture_not_compiled_in(bumps_store, view):
    """A first call with the module's buffer (or a view of it) as the argument compiled a graph whose input ``x`` was
    the buffer: a later call with another tensor of that shape hit it and read the buffer for ``x`` (6 where eager
    gives 3), in this process and a warm one. Such a call is refused at capture; other calls are served as usual (the
    first case compiles the entry for ``x``, the second loads it from the store they share)."""
    m = BumpsBuffer(bumps_store)
    with torch.no_grad():
        with pytest.raises(gearcache.UnsupportedInputError, match="buffer buf"):
            m.cached(m.buf[:, :] if view else m.buf)
        torch.testing.assert_close(m.buf, torch.arange(8.).reshape(2, 4))      # the refused call wrote nothing
        x = torch.ones(2, 4)
        got, buf = m.cached(x), m.buf.clone()
        m.buf.sub_(1)
        torch.testing.assert_close(got, m.fwd(x))
        torch.testing.assert_close(buf, m.buf)


@pytest.mark.slow
def test_a_method_returning_its_inputs_as_they_are_is_served_as_eager_cold_and_warm(tmp_path):
    """``return x``: a graph whose every output is an input compiles to nothing Inductor saves (before: RuntimeError
    "CompiledArtifact.save failed ... no artifact to save"); such outputs are read from the inputs: the caller's
    tensor, the module's buffer, the argument written in place, as the very objects eager returns."""
    from conftest import Script

    cold = Script("run_returns_inputs.py", str(tmp_path)).result()
    warm = Script("run_returns_inputs.py", str(tmp_path)).result()
    for report in (cold, warm):
        assert report["calls"] == {"same": True, "bumped": True, "state": True, "pair": True}, report
    assert (cold["compiles"], warm["compiles"], warm["loads"]) == (4, 0, 4), (cold, warm)


def test_a_named_tuple_holding_a_dataclass_is_returned_as_eager_returns_it_cold_and_warm(tmp_path):
    """A result holding a named tuple and a dataclass (``{"pair": Pair(Box(t, 3), x * 2)}``) was refused (Dynamo
    inlines the named tuple's ``__new__`` and guards its namespace, installed by identity): rebuilt now at every
    call from its classes, found by name, as the very classes eager returns, in the compiling and a warm process."""
    from conftest import Script

    cold = Script("run_records.py", str(tmp_path)).result()
    warm = Script("run_records.py", str(tmp_path)).result()
    assert cold["equal"] and warm["equal"], (cold, warm)
    assert (cold["compiles"], warm["compiles"], warm["loads"]) == (1, 0, 1), (cold, warm)


@dataclasses.dataclass
class _Rescaled:
    t: torch.Tensor

    def __post_init__(self):
        self.t = self.t * 2


def test_a_result_class_another_process_cannot_rebuild_is_refused_naming_it(tmp_path):
    """A named tuple defined inside a function (not found by name elsewhere) and a dataclass with a
    ``__post_init__`` (which would run again on the rebuilt values: 4x where eager gives 2x) are refused at the
    capture, each naming the class and the fix."""
    import collections

    Local = collections.namedtuple("Local", "t")

    class Returns(torch.nn.Module):
        def __init__(self, make):
            super().__init__()
            self.make = make
            self.cached = gearcache.cache_compile(self.fwd, cache_dir=tmp_path)

        def fwd(self, x):
            return self.make(x + 1)

    for make, message in ((Local, r"Local, a namedtuple class defined inside a function.*Fix: define Local"),
                          (_Rescaled, r"_Rescaled, a dataclass with a __post_init__")):
        with torch.no_grad(), pytest.raises(gearcache.UnsupportedInputError, match=message):
            Returns(make).cached(torch.ones(2))


class VarArgs(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, *rest, **named):
        out = x
        for r in rest:
            out = out + r
        for value in named.values():
            out = out * value
        return out


@pytest.mark.parametrize("call", ["no-named", "no-rest", "both"])
def test_a_method_with_star_args_and_star_kwargs_is_served_as_eager_when_either_is_empty(tmp_path, call):
    """``*rest`` and ``**named`` are always bound (an empty tuple or dict), never defaults: a call leaving either
    empty was a KeyError at the first call (Dynamo's guard on ``L['named']`` read as a default); the signature key
    has their structure, so the entry is served, and stored."""
    x, b = torch.randn(3, 4), torch.randn(4)
    args, kwargs = {"no-named": ((x, b), {}), "no-rest": ((x,), {"w": 2.0}), "both": ((x, b), {"w": 2.0})}[call]
    with torch.no_grad():
        model = VarArgs(tmp_path)
        got = model.cached(*args, **kwargs)
        again = VarArgs(tmp_path).cached(*args, **kwargs)        # another object: a load of the stored entry
    want = model.fwd(*args, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert any((tmp_path / "entries").rglob("*")), "the entry is stored (its guards persist)"


class CallsCached(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.inner_cached = gearcache.cache_compile(self.inner, cache_dir=cache_dir)
        self.cached = gearcache.cache_compile(self.outer, cache_dir=cache_dir)

    def inner(self, x):
        return self.lin(x)

    def outer(self, x):
        return self.inner_cached(x) + 1


def test_a_cached_method_calling_another_is_one_break_naming_the_line_and_the_fix(tmp_path):
    """Dynamo cannot trace a ``CachedFunction``'s call: the error names the user's line and the fix (call the plain
    method), and nothing of the inner method is compiled meanwhile (it was, under ``torch._dynamo.explain``, which
    traced gearcache's own compile and listed its internals as the breaks)."""
    model = CallsCached(tmp_path)
    with pytest.raises(gearcache.GraphBreakError) as info, torch.no_grad():
        model.cached(torch.randn(3, 4))
    text = str(info.value)
    assert len(info.value.breaks) == 1
    assert "test_capture.py" in text and "self.inner_cached(x)" in text
    assert "plain method" in text and "gearcache/" not in text.split("How to fix")[0]
    artifacts = tmp_path / "artifacts"
    assert not artifacts.exists() or not any(artifacts.iterdir()), "the inner method was not compiled"


class BreaksAfterWrites(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, y):
        self.count.add_(1)
        y.add_(1)
        if x.sum().item() > 0:          # a graph break
            return x * 2
        return x


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_call_refused_for_a_graph_break_writes_nothing(tmp_path, mode):
    """Listing the breaks runs the method under ``torch._dynamo.explain``, eagerly between its graphs: the refused
    call wrote its buffer and its argument once (a caller falling back to eager then counted twice). Both are as
    before the call (inference tensors too, which keep no version counter)."""
    model = BreaksAfterWrites(tmp_path)
    with getattr(torch, mode)():
        x, y = torch.ones(3), torch.zeros(3)
        with pytest.raises(gearcache.GraphBreakError, match="item"):
            model.cached(x, y)
    assert torch.equal(model.count, torch.zeros(3)) and torch.equal(y, torch.zeros(3))
    assert torch.equal(x, torch.ones(3))


class WritesPython(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.calls, self.seen, self.last = 0, [], None
        self.counting = gearcache.cache_compile(self.count, cache_dir=cache_dir)
        self.appending = gearcache.cache_compile(self.append, cache_dir=cache_dir)
        self.storing = gearcache.cache_compile(self.store, cache_dir=cache_dir)

    def count(self, x):
        self.calls += 1
        return x * 2

    def append(self, x):
        self.seen.append(1)
        return x * 3

    def store(self, x):
        self.last = x * 5
        return x + 1


@pytest.mark.parametrize("method, written", [("counting", "self"), ("appending", "self.seen"),
                                             ("storing", "self")])
def test_a_method_writing_python_state_is_refused_naming_it_and_writes_nothing(tmp_path, method, written):
    """A compiled entry runs the graph only: ``self.calls += 1`` counted 1 after 3 calls, ``self.seen.append`` grew
    once, and ``self.last = x * 5`` held the capture's uninitialised tensor (eager: 5s). Refused at the first call,
    naming what it writes and the fix; nothing is written."""
    model = WritesPython(tmp_path)
    with pytest.raises(gearcache.GearcacheError, match=rf"writes Python state .*\({written}\).*register_buffer"):
        with torch.no_grad():
            getattr(model, method)(torch.ones(3))
    assert model.calls == 0 and model.seen == [] and model.last is None


@pytest.mark.parametrize("method", ["count", "append", "store"])
def test_the_side_effect_reading_of_torch_without_the_replayed_sources_method_lists_the_same(tmp_path, method):
    """``_torch.capture.local_side_effects`` reads Dynamo's ``get_replayed_side_effect_source_refs`` where it exists
    (2.13+) and ``replayed_sources`` where it does not (2.11, the GPU host's torch): on a torch that has both, the two
    list the same sources for each kind of Python write; on 2.11 the fallback names the write to ``self``."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    from gearcache._torch import capture as torch_capture
    seen = []

    def backend(gm, example_inputs):
        output = InstructionTranslator.current_tx().output
        want = getattr(output, "get_replayed_side_effect_source_refs", None)
        seen.append((want() if want is not None else None, torch_capture.replayed_sources(output)))
        return gm.forward

    model = WritesPython(tmp_path)
    torch._dynamo.reset()
    torch.compile(getattr(model, method), backend=backend, fullgraph=True)(torch.ones(3))
    torch._dynamo.reset()
    assert seen, "the backend ran"
    want, got = seen[0]
    assert any(r.startswith("L['self']") for r in got), got
    assert want is None or got == want
