"""Gears: marking, zip and product plans, padding and cutting, past-largest policies, verify mode, warm start."""
import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gearcache
from conftest import run_script
from gear_models import BatchSoftmax, Mixed, PairMLP
from gearcache import CompilerConfig, ConfigError, counters, mark_static, set_dim_gears
from gearcache.call import signature
from gearcache.gears.plan import GearPlan, MarkedCall, MarkedDim


# ------------------------------------------------------------------------------------------------------- marking
def test_set_dim_gears_normalises_and_validates():
    t = torch.zeros(3, 5)
    set_dim_gears(t, {-1: [8, 1, 4, 4]})
    assert t._gearcache_dim_gears == {1: [1, 4, 8]}
    set_dim_gears(t, {1: [1, 4, 8]})                       # the same gears again: fine
    with pytest.raises(ConfigError, match="already has gears"):
        set_dim_gears(t, {1: [2]})
    for bad, match in [({0: [0, 2]}, "positive"), ({0: [2.5]}, "positive"), ({0: []}, "non-empty"),
                       ({2: [1]}, "out of range"), ({"a": [1]}, "integers"), ([1, 2], "dict")]:
        with pytest.raises(ConfigError, match=match):
            set_dim_gears(torch.zeros(3, 5), bad)
    set_dim_gears(torch.zeros(1), {0: [1]})                # size 1 and a single-size list are allowed
    with pytest.raises(ConfigError, match="not a torch.Tensor"):
        set_dim_gears([1, 2], {0: [1]})
    s = mark_static(torch.zeros(2))
    with pytest.raises(ConfigError, match="static"):
        set_dim_gears(s, {0: [2]})


def _plan(policy, sizes_per_dim, groups=None):
    dims = [MarkedDim(i, 0, sizes, f"a{i}") for i, sizes in enumerate(sizes_per_dim)]
    return GearPlan(dims, groups or [[i] for i in range(len(dims))], policy, {}, "error")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=5).map(lambda s: sorted(set(s))),
                min_size=1, max_size=3), st.data())
def test_product_resolver_picks_the_smallest_covering_gear(sizes_per_dim, data):
    plan = _plan("product", sizes_per_dim)
    call = [data.draw(st.integers(1, 45)) for _ in sizes_per_dim]
    leaves = tuple(torch.empty(n, 0) for n in call)
    chosen = plan.targets(leaves)
    covering = [c for c in plan.combinations() if all(g >= n for g, n in zip(c, call))]
    if not covering:
        assert chosen is None
        return
    assert all(g >= n for g, n in zip(chosen, call)), "the chosen gear covers the call"
    volume = lambda c: torch.tensor(c, dtype=torch.float64).prod().item()   # noqa: E731
    assert volume(chosen) == min(volume(c) for c in covering), "no smaller gear covers it"


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(st.lists(st.integers(1, 30), min_size=n, max_size=n)
                                                    .map(sorted), min_size=1, max_size=3)), st.data())
def test_zip_resolver_picks_the_first_covering_gear(sizes_per_dim, data):
    plan = _plan("zip", sizes_per_dim, [list(range(len(sizes_per_dim)))])
    call = [data.draw(st.integers(1, 32)) for _ in sizes_per_dim]
    chosen = plan.targets(tuple(torch.empty(n, 0) for n in call))
    covering = [c for c in plan.combinations() if all(g >= n for g, n in zip(c, call))]
    assert chosen == (covering[0] if covering else None)


# ---------------------------------------------------------------------------------------------------- serving
@pytest.fixture(scope="module")
def pair_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gears")


def test_gear_calls_are_the_example_narrowed_or_padded_to_every_gear():
    x, ids = torch.randn(3, 5), torch.arange(3)
    leaves, key = signature.call_key((x,), {"ids": ids})
    marks = [MarkedDim(0, 0, [2, 4], "x"), MarkedDim(1, 0, [2, 4], "ids", -1)]
    call = MarkedCall((x,), {"ids": ids}, leaves, key, {0: "x", 1: "ids"}, marks, False)
    small, large = GearPlan(marks, [[0, 1]], "product", {}, "error").gear_calls(call)
    assert (small.sizes, large.sizes) == ([2, 2], [4, 4])
    assert small.leaves[0].is_contiguous() and torch.equal(small.leaves[0], x[:2])
    assert torch.equal(small.leaves[1], ids[:2])
    assert torch.equal(large.leaves[0][:3], x) and not large.leaves[0][3].any()       # no pad value given: 0
    assert large.leaves[1].tolist() == [0, 1, 2, -1]
    for gear in (small, large):             # the key and the arguments of the gear's own call
        assert gear.key == signature.call_key(gear.args, gear.kwargs)[1]
        assert gear.args[0] is gear.leaves[0] and gear.kwargs["ids"] is gear.leaves[1]


def test_zip_pads_every_size_and_matches_eager(pair_cache):
    torch.manual_seed(0)
    m = PairMLP(pair_cache)
    x, y = set_dim_gears(torch.zeros(2, 4), {0: [2, 4]}), set_dim_gears(torch.zeros(2, 4), {0: [2, 4]})
    with torch.no_grad():
        assert m.cached.warmup(x, y) == 2
        with counters.expect(compiles=0, traces=0):
            for n in range(1, 5):
                a, b = torch.randn(n, 4), torch.randn(n, 4)
                out, total = m.cached(a, b)
                ref, ref_total = m.fwd(a, b)
                assert out.shape == (n, 3) and total.shape == (n,)
                torch.testing.assert_close(out, ref)
                torch.testing.assert_close(total, ref_total)
        assert m.cached.entries == 2


def test_calls_whose_tensors_lost_their_marks_are_padded_all_the_same(pair_cache):
    """The gear plan is kept from the first marked call: later tensors need no marks (slices and clones drop them)."""
    torch.manual_seed(0)
    m = PairMLP(pair_cache)
    x, y = set_dim_gears(torch.randn(4, 4), {0: [2, 4]}), set_dim_gears(torch.randn(4, 4), {0: [2, 4]})
    with torch.no_grad():
        m.cached.warmup(x, y)
        for a, b in [(x[:3], y[1:4]), (x[:1].clone(), y[:1].clone()), ((x * 2)[:3], y[:3] + 1)]:
            assert not hasattr(a, "_gearcache_dim_gears") and not hasattr(b, "_gearcache_dim_gears")
            gear = 2 if len(a) <= 2 else 4                  # elements of x and y, as passed and as run (padded)
            with counters.expect(compiles=0, traces=0, pads=1, real_elements=2 * 4 * len(a),
                                 padded_elements=2 * 4 * gear):
                out, total = m.cached(a, b)
            ref, ref_total = m.fwd(a, b)
            torch.testing.assert_close(out, ref)
            torch.testing.assert_close(total, ref_total)


def test_a_call_during_a_torch_fx_trace_keeps_the_gear_plan_and_its_entries(pair_cache):
    """A call whose watch fires while ``torch.fx``'s tracer has ``nn.Module.__call__`` and ``__getattr__`` patched (a
    trace in any thread: ``make_fx`` under every compile in the process) re-checks its guards on the patched class:
    the gear plan and the entries hold, and this call and the next are padded, with nothing compiled or traced. Was:
    the guard on the module's class failed, both were dropped, and later unmarked calls compiled an entry per size,
    unpadded (a warm-up compiling a gear in a thread of its own: overlapping padded views were then served instead of
    refused, ``test_padded_arguments_that_are_apart_views_of_one_tensor_are_served``)."""
    torch.manual_seed(0)
    m = PairMLP(pair_cache)
    x, y = set_dim_gears(torch.randn(4, 4), {0: [2, 4]}), set_dim_gears(torch.randn(4, 4), {0: [2, 4]})
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    served = []

    class Probe(torch.nn.Module):
        def forward(self, t):
            with counters.expect(compiles=0, traces=0, pads=1):
                served.append(m.cached(a, b))
            return t

    with torch.no_grad():
        m.cached.warmup(x, y)
        torch.fx.symbolic_trace(Probe())
        with counters.expect(compiles=0, traces=0, pads=1):
            served.append(m.cached(a, b))
        ref = m.fwd(a, b)
    assert m.cached.entries == 2
    for out in served:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_marks_on_a_call_after_an_unmarked_first_call_build_the_gear_plan(pair_cache):
    torch.manual_seed(0)
    gears = {0: [2, 4]}
    with torch.no_grad():
        PairMLP(pair_cache).cached.warmup(set_dim_gears(torch.zeros(4, 4), gears),
                                          set_dim_gears(torch.zeros(4, 4), gears))     # loaded if compiled above
        m = PairMLP(pair_cache)
        m.cached(torch.randn(2, 4), torch.randn(2, 4))      # unmarked: an exact entry (gear 2's signature)
        a, b = set_dim_gears(torch.randn(3, 4), gears), set_dim_gears(torch.randn(3, 4), gears)
        with counters.expect(compiles=0, traces=0, pads=1):
            out, total = m.cached(a, b)                      # the plan (stored), then padded to the 4-gear
        ref, ref_total = m.fwd(a, b)
    assert m.cached.gear_life.plan is not None and out.shape == (3, 3)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(total, ref_total)


def test_past_largest_gear_policies(pair_cache):
    def model(policy):
        cfg = CompilerConfig()
        cfg.inference_config.dim_gears = {"x": {0: [2, 4]}, "y": {0: [2, 4]}}
        cfg.inference_config.past_largest_gear = policy
        torch.manual_seed(0)
        return PairMLP(pair_cache, cfg)

    big = (torch.randn(6, 4), torch.randn(6, 4))
    with torch.no_grad():
        m = model("error")
        m.cached(torch.randn(3, 4), torch.randn(3, 4))
        with pytest.raises(gearcache.PastLargestGearError, match=r"argument x, dim 0: size 6 .* largest gear 4"):
            m.cached(*big)
        m = model("eager")
        with pytest.warns(UserWarning, match="uncompiled"), counters.expect(eager_calls=1, compiles=0):
            out, _ = m.cached(*big)
        with warnings.catch_warnings():
            warnings.simplefilter("error")                      # warned once only
            with counters.expect(eager_calls=1):
                m.cached(*big)
        torch.testing.assert_close(out, m.fwd(*big)[0])
        m = model("compile")
        with counters.expect(compiles=1):
            out, _ = m.cached(*big)
        torch.testing.assert_close(out, m.fwd(*big)[0])


class EmptyRows(torch.nn.Module):
    """Row-wise, or with a max over the geared rows (eager raises on 0 rows; padded rows would give -inf)."""

    def __init__(self, cache_dir, kind, config=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kind = kind
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        return (self.lin(x), x.amax(0)) if self.kind == "amax" else self.lin(x)


@pytest.mark.parametrize("policy", ["error", "eager", "compile"])
def test_a_call_with_an_empty_geared_dim_is_served_by_the_method_itself(tmp_path, policy):
    """Padded up to its smallest gear, a call with 0 rows returned -inf for ``x.amax(0)`` where eager raises
    ``IndexError`` (a reduction over an empty dim without an identity); padding cannot be exact there, whatever the
    pad value. Such a call runs the method itself, under every ``past_largest_gear`` policy: eager's error, or eager's
    (empty) result for a row-wise method; nothing compiles."""
    config = CompilerConfig()
    config.inference_config.past_largest_gear = policy
    torch.manual_seed(0)
    x = torch.randn(0, 4)
    with torch.no_grad():
        amax, rows = EmptyRows(tmp_path, "amax", config), EmptyRows(tmp_path, "rows", config)
        with pytest.raises(IndexError, match="non-zero size"):
            amax.fwd(x)
        before = counters.snapshot()
        with pytest.raises(IndexError, match="non-zero size"):
            amax.cached(set_dim_gears(x.clone(), {0: [2, 4]}))
        out = rows.cached(set_dim_gears(x.clone(), {0: [2, 4]}))
        assert out.shape == (0, 4)
        torch.testing.assert_close(out, rows.fwd(x))
        got = counters.delta(before)
        assert got["eager_calls"] == 2 and got["compiles"] == 0, got


def test_zip_needs_lists_of_one_length(tmp_path):
    m = PairMLP(tmp_path)
    x, y = set_dim_gears(torch.zeros(2, 4), {0: [2, 4]}), set_dim_gears(torch.zeros(2, 4), {0: [2, 4, 8]})
    with torch.no_grad(), pytest.raises(ConfigError, match="same length"):
        m.cached(x, y)


def test_product_moves_dims_that_meet_in_lockstep(tmp_path):
    cfg = CompilerConfig()
    cfg.inference_config.dynamic_gears_merge_policy = "product"
    m = Mixed(tmp_path, cfg)
    x = set_dim_gears(torch.randn(2, 3), {0: [2, 4]})
    y = set_dim_gears(torch.randn(2, 3), {0: [2, 4]})
    z = set_dim_gears(torch.randn(5), {0: [5, 9]})
    with torch.no_grad():
        out, zs = m.cached(x, y, z)
        plan = m.cached.gear_life.plan
        assert sorted(map(sorted, plan.groups)) == [[0, 1], [2]]          # x and y together, z alone
        assert len(plan.combinations()) == 4                               # not 2 * 2 * 2 = 8
        a, b, c = torch.randn(3, 3), torch.randn(3, 3), torch.randn(7)
        out, zs = m.cached(a, b, c)
        torch.testing.assert_close(out, (a + b) * 2)
        torch.testing.assert_close(zs, c.sin())
        with pytest.raises(ConfigError, match="must be equal"):
            m.cached(torch.randn(3, 3), torch.randn(1, 3), c)


@pytest.mark.slow
def test_padding_check_verify_tests_the_gears_the_analysis_proved(tmp_path, pair_cache):
    cfg = CompilerConfig()
    cfg.inference_config.dim_gears = {"x": {0: [2, 4]}}
    cfg.inference_config.padding_check = "verify"
    # PairMLP's gears 2 and 4, compiled above (padding_check is no key factor): the warm-up below loads them instead
    # of compiling them again; it tests every gear against eager whether it compiled or loaded it
    shutil.copytree(pair_cache, tmp_path / "b", ignore=shutil.ignore_patterns("locks", "index", "leases"))
    with torch.no_grad():
        # a softmax over the batch: proved exact with pad -inf (chosen); gear 4 is tested (real size 3), gear 2 is
        # never padded (real size 1 pads to 2: tested too)
        with counters.expect(padding_verifications=2):
            BatchSoftmax(tmp_path / "a", cfg).cached.warmup(torch.randn(4, 3))
        with counters.expect(padding_verifications=2):
            PairMLP(tmp_path / "b", cfg.model_copy(update={"inference_config": cfg.inference_config.model_copy(
                update={"dim_gears": {"x": {0: [2, 4]}, "y": {0: [2, 4]}}})})).cached.warmup(
                torch.randn(4, 4), torch.randn(4, 4))                      # a row-wise model passes


def test_config_gears_name_unknown_arguments(tmp_path):
    cfg = CompilerConfig()
    cfg.inference_config.dim_gears = {"q": {0: [2]}}
    with torch.no_grad(), pytest.raises(ConfigError, match=r"\['q'\]"):
        PairMLP(tmp_path, cfg).cached(torch.randn(2, 4), torch.randn(2, 4))


def test_fresh_process_compiles_nothing_for_any_gear(gears_cache, empty_torch_caches):
    cache, cold = gears_cache
    assert cold["equal"] and cold["gears"] == 3 and cold["compiles_after_warmup"] == 0
    assert cold["counters"]["compiles"] == 3 and cold["counters"]["traces"] == 4    # 3 graphs + 1 symbolic trace
    warm = run_script("run_gears.py", str(cache), "--hooks", env=empty_torch_caches)
    assert warm["equal"]
    assert warm["counters"]["loads"] == 3 and warm["counters"]["compiles"] == 0 and warm["counters"]["traces"] == 0
    assert warm["hooks"]["dynamo_frames"] == 0 and warm["hooks"]["inductor_compiles"] == 0
    assert warm["hooks"]["cpp_builds"] == 0 and warm["hooks"]["triton_compiles"] == 0



def test_a_change_the_watch_cannot_see_between_two_gears_loads_is_caught_at_the_next_load(gears_cache, tmp_path):
    """The per-call watch does not see a hook written into a module's hook dict by hand, nor a module's
    ``__class__`` swapped (docs/DESIGN.md, "Not seen per call"): the next load reads every guard of its entry, so a
    gear loaded after such a change is refused (``on_new_signature="error"``), never served from its stored entry.
    (Skipping the guard read of a set a loaded gear shares was tried on 2026-11-26 and served these stale.)"""
    cache, _ = gears_cache
    config = CompilerConfig(on_new_signature="error")
    config.inference_config.dim_gears = {"x": {0: [2, 4, 8]}, "y": {0: [2, 4, 8]}}

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 10.0

    changes = {"hook": lambda m: m.lin._forward_hooks.__setitem__(12345, lambda mod, args, out: out * 2),
               "class": lambda m: setattr(m.lin, "__class__", Scaled)}
    for name, change in changes.items():
        folder = tmp_path / name
        shutil.copytree(cache, folder)
        torch.manual_seed(0)
        model = PairMLP(str(folder), config).eval()
        with torch.inference_mode():
            x, y = torch.randn(2, 4), torch.randn(2, 4)
            torch.testing.assert_close(model.cached(x, y), model.fwd(x, y))      # gear 2 loaded
            change(model)
            x, y = torch.randn(3, 4), torch.randn(3, 4)
            with pytest.raises(gearcache.SignatureMismatchError):
                model.cached(x, y)                  # gear 4's first load: its guards read, the stored entry refused


class CacheViews(torch.nn.Module):
    """A decode step over a KV cache passed as views of one tensor (``kv[0]``, ``kv[1]``), the key cache scaled in
    place; gears on the batch of ``x`` only (the caches are not padded)."""

    def __init__(self, cache_dir=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, k_cache, v_cache):
        k_cache.mul_(0.5)
        return torch.softmax(self.lin(x) @ k_cache.T, -1) @ v_cache


@pytest.mark.slow
def test_unpadded_arguments_that_are_views_of_one_tensor_are_served_with_a_padded_call(tmp_path):
    """Padding copies only the padded arguments: caches passed as ``kv[0]``, ``kv[1]`` beside a padded ``x`` equal
    eager (output and cache), in the compiling module and in a second one loading its entries; rows 0-3 and 2-5 of
    ``kv.view(-1, 8)`` (overlapping, the first written) too, by an entry of their own. Was: every padded call
    refused ("arguments k_cache, v_cache are one tensor or views of one storage; padding copies the padded ones")."""
    views = {"disjoint": lambda kv: (kv[0], kv[1]), "overlapping": lambda kv: (kv.view(-1, 8)[0:4],
                                                                                 kv.view(-1, 8)[2:6])}
    compiles = 0
    for attempt in ("cold", "loaded"):
        m, e = CacheViews(str(tmp_path)), CacheViews()
        with torch.no_grad():
            m.cached.warmup(set_dim_gears(torch.randn(4, 8), {0: [2, 4]}), *views["disjoint"](torch.randn(3, 4, 8)))
            for name in ("disjoint", "overlapping", "disjoint"):
                x, kv = torch.randn(3, 8), torch.randn(3, 4, 8)
                eager_kv = kv.clone()
                out = m.cached(x, *views[name](kv))
                torch.testing.assert_close(out, e.fwd(x, *views[name](eager_kv)), rtol=0, atol=1e-6)
                assert torch.equal(kv, eager_kv), (attempt, name)
        if attempt == "loaded":
            assert gearcache.counters.compiles == compiles, "the second module loads every entry"
        compiles = gearcache.counters.compiles


@pytest.mark.slow
def test_a_warm_up_over_views_of_one_tensor_does_not_serve_separate_tensors(tmp_path):
    """A warm-up whose example passes ``k``, ``v`` as overlapping views of one tensor (``k`` written, not padded):
    each gear's entry is keyed as views (``GearPlan.gear_calls`` keeps the marks of the leaves it leaves as they
    are), so later calls with separate tensors get an entry of their own and equal eager. Was: the gear's key
    dropped the marks, and a call with separate tensors at that gear ran the entry compiled over one base
    (AssertionError in Inductor's size check, 'wrong number of dimensions')."""
    m, e = CacheViews(str(tmp_path)), CacheViews()
    with torch.no_grad():
        base = torch.randn(6, 8)
        m.cached.warmup(set_dim_gears(torch.randn(4, 8), {0: [2, 4]}), base[0:4], base[2:6])
        for n in (4, 3):
            x, k, v = torch.randn(n, 8), torch.randn(4, 8), torch.randn(4, 8)
            eager_k, eager_v = k.clone(), v.clone()
            torch.testing.assert_close(m.cached(x, k, v), e.fwd(x, eager_k, eager_v), rtol=0, atol=1e-6)
            assert torch.equal(k, eager_k) and torch.equal(v, eager_v), n


class UnbindCache(torch.nn.Module):
    """A decode step writing its KV cache at ``pos``: caches ``[B, T, 8]``, gears on the batch of all three."""

    def __init__(self, cache_dir=None):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(8, 24)
        if cache_dir is not None:
            self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x, k_cache, v_cache, pos):
        q, k, v = self.qkv(x).split(8, -1)
        k_cache.index_copy_(1, pos, k)
        v_cache.index_copy_(1, pos, v)
        return torch.softmax(q @ k_cache.transpose(1, 2), -1) @ v_cache


@pytest.mark.slow
def test_padded_arguments_that_are_apart_views_of_one_tensor_are_served(tmp_path):
    """Caches ``kv.unbind(0)`` (views of one tensor, elements apart), padded on the batch beside ``x`` and written:
    each padded copy is written and copied back apart, as eager writes them; equal eager, output and cache. Views
    whose elements overlap stay refused. Was: every padded call refused ("arguments k_cache, v_cache are one tensor
    or views of one storage"); and in 1 run of 3 the overlapping views served, unpadded: the warm-up compiles its gears
    in a thread of this process (views of one tensor), whose ``make_fx`` patched ``nn.Module`` while the first gear's
    entry was remembered, so the guards failed on the module's class and the gear plan was dropped
    (``test_a_call_during_a_torch_fx_trace_keeps_the_gear_plan_and_its_entries``)."""
    gears = {0: [2, 4]}
    m, e = UnbindCache(str(tmp_path)), UnbindCache()
    with torch.no_grad():
        k0, v0 = torch.zeros(2, 4, 6, 8).unbind(0)
        m.cached.warmup(set_dim_gears(torch.randn(4, 1, 8), gears), set_dim_gears(k0, gears),
                        set_dim_gears(v0, gears), torch.tensor([0]))
        kv, eager_kv = torch.zeros(2, 3, 6, 8), torch.zeros(2, 3, 6, 8)
        for t in range(3):
            x, pos = torch.randn(3, 1, 8), torch.tensor([t])
            out = m.cached(x, *kv.unbind(0), pos)
            torch.testing.assert_close(out, e.fwd(x, *eager_kv.unbind(0), pos), rtol=0, atol=1e-6)
            torch.testing.assert_close(kv, eager_kv, rtol=0, atol=1e-6)      # a Linear's rounding, compiled
        flat = torch.zeros(4, 6, 8)     # overlapping padded views: refused (copies_split), nothing written
        with pytest.raises(gearcache.UnsupportedInputError, match="k_cache, v_cache are one tensor or views"):
            m.cached(torch.randn(3, 1, 8), flat[0:3], flat[1:4], torch.tensor([0]))
        assert not flat.any()


def test_an_example_narrowed_to_a_gear_has_the_strides_of_a_call_at_that_gear():
    """``narrowed`` cut (2, 5, 8) to (1, 4, 8) with ``.contiguous()``, which kept stride 40 in the size-1 dim (torch
    calls it contiguous): a signature other than a real call's padded (1, 4, 8) tensor, stride 32, so warmup()'s
    entry for that gear served no call and the first call at it compiled."""
    from gearcache.gears.plan import MarkedDim, narrowed

    x = torch.randn(2, 5, 8)
    dims = [MarkedDim(0, 0, [1, 4], "x"), MarkedDim(0, 1, [4, 8], "x")]
    (cut,) = narrowed((x,), dims, [1, 4])
    assert cut.shape == (1, 4, 8) and cut.stride() == torch.empty(1, 4, 8).stride()
    torch.testing.assert_close(cut, x[:1, :4])


class RowScale(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        return x * 2


@pytest.mark.slow
def test_after_warmup_a_call_padded_to_a_gear_with_a_size_one_dim_compiles_nothing(tmp_path):
    """Gears on two dims, the smallest gear (1, 4): warmup()'s example at that gear must key as a real call there."""
    model = RowScale(tmp_path)
    with torch.no_grad():
        assert model.cached.warmup(set_dim_gears(torch.randn(2, 5), {0: [1, 2], 1: [4, 8]})) == 2
        x = set_dim_gears(torch.randn(1, 3), {0: [1, 2], 1: [4, 8]})
        with counters.expect(compiles=0):
            out = model.cached(x)
    torch.testing.assert_close(out, x * 2)
