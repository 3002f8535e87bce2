"""CUDA graphs per gear (mode="reduce-overhead"). The GPU tests need CUDA: on the device machine run
``GEARCACHE_TEST_DEVICE=cuda python -m pytest tests/test_cuda_graphs.py``; CI (no GPU) runs the CPU fallback test."""
import pytest
import torch

import gearcache
from gearcache import CompilerConfig, counters, mark_static_address
from gearcache.graphs import gear_threads, graphed_entry
from gearcache import snapshot

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")


class Step(torch.nn.Module):
    """A decode-like step: a per-row MLP plus an in-place KV cache update at `pos`."""

    def __init__(self, cache_dir, config):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir, config=config)
        self.cached_kv = gearcache.cache_compile(self.fwd_kv, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        return torch.tanh(self.lin(x)) * 2, x.sum(-1)

    def fwd_kv(self, x, kv, pos):
        kv.index_copy_(1, pos, self.lin(x))          # in place, as a static KV cache is
        kv.mul_(0.5)                                 # not idempotent: applied twice would be wrong
        return kv.sum(1)


def _config(**gears):
    cfg = CompilerConfig(mode="reduce-overhead")
    cfg.inference_config.dim_gears = gears
    return cfg


def test_reduce_overhead_on_cpu_inputs_runs_the_same_entries(tmp_path):
    m = Step(tmp_path, _config(x={0: [2, 4]}))
    x = torch.randn(3, 8)
    with torch.no_grad(), counters.expect(graph_captures=0):
        out, total = m.cached(x)
    torch.testing.assert_close(out, m.fwd(x)[0])


def test_a_process_without_a_process_group_warms_gears_up_in_threads():
    # (tests/test_ranks.py: under torchrun with 2 and 4 ranks it is True, and capture_all then takes one thread)
    assert gear_threads.collectives_possible() is False


def test_snapshot_restores_every_view_of_a_storage_from_one_copy():
    """capture_all restores what the gears' warm-up runs wrote to static-address inputs: gears' views of one KV cache
    share a storage, saved once (the smallest byte range holding them all), other storages apart."""
    kv = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    other = torch.arange(5, dtype=torch.int64)
    after_last = kv[1, 5].clone()                 # past the last byte of every view
    views = [kv[:, :4], kv[:, :1], kv[1:, 2:5], other[1:3]]
    saved = snapshot.snapshot(views)
    assert len(saved) == 2, "one copy per storage"
    assert saved[0][0].numel() == (kv[1, 4, 3].data_ptr() + 4 - kv.data_ptr()), "the smallest range covering them"
    expected = [v.clone() for v in views]
    kv.mul_(-1)
    other.mul_(-1)
    for view, before in saved:
        view.copy_(before)
    for v, e in zip(views, expected):
        assert torch.equal(v, e)
    assert torch.equal(kv[1, 5], -after_last), "bytes outside the saved range are not touched"


def test_run_plan_tells_which_copied_inputs_a_graph_writes_so_each_replay_copies_them_back(tmp_path):
    """The KV step's entry (compiled on CPU) writes its input 1 in place: from the run plan alone, a capture that
    copies that input into a buffer of its own knows to copy the buffer back after each replay; a static-address
    input (not copied) needs nothing."""
    m = Step(tmp_path, _config())
    x, kv, pos = torch.randn(2, 1, 8), torch.zeros(2, 4, 8), torch.tensor([0])
    with torch.no_grad():
        m.cached_kv(x, kv, pos)
    entry = next(iter(m.cached_kv._table.values()))
    assert counters.direct_loads >= 1 and graphed_entry.mutated_leaves(entry) == [1]
    buf = kv.clone()
    assert [(i, b is buf) for i, b in graphed_entry.written_copies(entry, [(0, x, 0.0), (1, buf, 0.0)])] == [(1, True)]
    assert graphed_entry.written_copies(entry, [(0, x, 0.0)]) == []
    graphed = graphed_entry.GraphedEntry(entry, None, [], [(1, buf, 0.0)], [])
    graphed.written = [(1, buf)]
    buf.fill_(7.0)
    real = torch.zeros(1, 4, 8)                         # a padded call's real rows: the first one of the buffer
    graphed.copy_back((x, real, pos))
    assert torch.equal(real, torch.full((1, 4, 8), 7.0))


@needs_cuda
def test_warmup_captures_every_gear_once_largest_first_in_one_pool(tmp_path):
    m = Step(tmp_path, _config(x={0: [1, 2, 4, 8]})).cuda()
    with torch.inference_mode():
        start = counters.snapshot()
        assert m.cached.warmup(torch.zeros(8, 8, device="cuda")) == 4
        grown = counters.delta(start)
        assert grown["graph_captures"] == 4 and grown["graph_warmups"] == 4
        graphed = list(m.cached.graphs.graphs.values())
        assert [g.copies[0][1].shape[0] for g in graphed] == [8, 4, 2, 1], "largest gear captured first"
        assert all(g.graph.pool() == m.cached.graphs.pool for g in graphed), "one memory pool for every gear"
        with counters.expect(graph_captures=0, graph_warmups=0):
            m.cached.warmup(torch.zeros(8, 8, device="cuda"))        # nothing captured twice
            for n in range(1, 9):
                x = torch.randn(n, 8, device="cuda")
                torch.testing.assert_close(m.cached(x)[0], m.fwd(x)[0])


@needs_cuda
def test_lazy_capture_loads_at_warmup_and_captures_each_gear_on_its_first_call(tmp_path):
    cfg = _config(x={0: [1, 2, 4, 8]})
    cfg.inference_config.capture_graphs = "first_call"
    m = Step(tmp_path, cfg).cuda()
    with torch.inference_mode():
        with counters.expect(graph_captures=0):
            assert m.cached.warmup(torch.zeros(8, 8, device="cuda")) == 4
        assert m.cached.entries == 4
        with counters.expect(graph_captures=2, compiles=0, traces=0):
            for n in (3, 4, 1, 3):                 # gears 4, 4, 1, 4: two captures
                x = torch.randn(n, 8, device="cuda")
                torch.testing.assert_close(m.cached(x)[0], m.fwd(x)[0])


@needs_cuda
def test_graph_replay_equals_eager_for_every_gear(tmp_path):
    torch.manual_seed(0)
    m = Step(tmp_path, _config(x={0: [1, 2, 4, 8]})).cuda()
    with torch.inference_mode():
        before = counters.graph_captures
        m.cached.warmup(torch.zeros(8, 8, device="cuda"))
        assert counters.graph_captures - before == 4
        for _ in range(3):
            for n in range(1, 9):
                x = torch.randn(n, 8, device="cuda")
                out, total = m.cached(x)
                ref, ref_total = m.fwd(x)
                torch.testing.assert_close(out, ref)
                torch.testing.assert_close(total, ref_total)
        assert counters.graph_captures - before == 4, "no capture after warm-up"


@needs_cuda
def test_kv_cache_updated_in_place_stays_right_over_100_steps(tmp_path):
    torch.manual_seed(0)
    m = Step(tmp_path, _config()).cuda()
    kv = mark_static_address(torch.zeros(2, 100, 8, device="cuda"))
    ref_kv = torch.zeros(2, 100, 8, device="cuda")
    with torch.inference_mode():
        for step in range(100):
            x = torch.randn(2, 1, 8, device="cuda")
            pos = torch.tensor([step], device="cuda")
            out = m.cached_kv(x, kv, pos)
            ref = m.fwd_kv(x, ref_kv, pos)
            torch.testing.assert_close(out, ref)
        torch.testing.assert_close(kv, ref_kv)
        with pytest.raises(gearcache.UnsupportedInputError, match="another tensor"):
            m.cached_kv(x, mark_static_address(kv.clone()), pos)


@needs_cuda
@pytest.mark.parametrize("outputs", ["copy", "view-checked"])
@pytest.mark.parametrize("geared", [False, True])
def test_an_unmarked_input_written_in_place_is_copied_back_after_each_replay(tmp_path, outputs, geared):
    """An input the graph writes, passed without mark_static_address (with gears, padded too: batches of 3 run on
    gear 4), is written in the graph's static buffer and copied back into the caller's tensor (its real rows) after
    each replay, as mode="default" copies a padded input back after a run: outputs and the written input equal eager,
    call after call (the step is not idempotent: kv.mul_(0.5))."""
    cfg = _config(**({"x": {0: [1, 2, 4]}, "kv": {0: [1, 2, 4]}} if geared else {}))
    cfg.inference_config.graph_outputs = outputs
    torch.manual_seed(0)
    m = Step(tmp_path, cfg).cuda()
    start = counters.snapshot()
    with torch.inference_mode():
        for step, b in enumerate([3, 3, 1, 4, 3] if geared else [2, 2, 2]):
            x, kv = torch.randn(b, 1, 8, device="cuda"), torch.randn(b, 6, 8, device="cuda")
            ref_kv, pos = kv.clone(), torch.tensor([step], device="cuda")
            out = m.cached_kv(x, kv, pos).clone()
            torch.testing.assert_close(out, m.fwd_kv(x, ref_kv, pos))
            torch.testing.assert_close(kv, ref_kv)
    assert counters.delta(start)["graph_captures"] == (2 if geared else 1), "gears 4 and 1 (geared), or one shape"


@needs_cuda
def test_view_checked_outputs_raise_when_read_after_the_next_call(tmp_path):
    cfg = _config()
    cfg.inference_config.graph_outputs = "view-checked"
    m = Step(tmp_path, cfg).cuda()
    x1, x2 = torch.randn(2, 8, device="cuda"), torch.randn(2, 8, device="cuda")
    with torch.inference_mode():
        first, _ = m.cached(x1)
        assert torch.allclose(first, m.fwd(x1)[0], atol=1e-5)        # readable until the next call
        second, _ = m.cached(x2)
        assert torch.allclose(second, m.fwd(x2)[0], atol=1e-5)
        with pytest.raises(RuntimeError, match="overwritten by a later call of the same method"):
            first.sum().item()
        third, _ = m.cached(x1)
        assert torch.allclose(third, m.fwd(x1)[0], atol=1e-5)
        expected = m.fwd(third.clone())[0]
        fourth, _ = m.cached(third)         # the last call's view as this call's input (a decode loop's KV cache)
        assert torch.allclose(fourth, expected, atol=1e-5)


@needs_cuda
def test_view_checked_outputs_raise_after_a_call_of_another_gear(tmp_path):
    """The gears' graphs share one pool: a gear captured later may keep its outputs where an earlier gear's graph
    keeps its intermediates, so a call of any gear retires every view handed out before it."""
    cfg = _config(x={0: [1, 2, 4, 8]})
    cfg.inference_config.graph_outputs = "view-checked"
    m = Step(tmp_path, cfg).cuda()
    with torch.inference_mode():
        m.cached.warmup(torch.randn(8, 8, device="cuda"))
        small = torch.randn(2, 8, device="cuda")
        out, _ = m.cached(small)
        assert torch.allclose(out, m.fwd(small)[0], atol=1e-5)
        m.cached(torch.randn(8, 8, device="cuda"))                         # another gear
        with pytest.raises(RuntimeError, match="overwritten by a later call of the same method"):
            out.sum().item()
        last, _ = m.cached(small)
        m.cached.graphs.reset()                                             # the graphs and their pool are dropped
        with pytest.raises(RuntimeError, match="overwritten by a later call of the same method"):
            last.sum().item()


@needs_cuda
def test_copied_outputs_of_every_gear_stay_right_across_calls_of_the_others(tmp_path):
    """graph_outputs="copy" (the default): each output is the caller's, whatever the other gears' replays write."""
    m = Step(tmp_path, _config(x={0: [1, 2, 4, 8]})).cuda()
    torch.manual_seed(0)
    xs = [torch.randn(b, 8, device="cuda") for b in (1, 2, 3, 4, 5, 8)]
    with torch.inference_mode():
        m.cached.warmup(torch.randn(8, 8, device="cuda"))
        kept = [m.cached(x) for x in xs]
        for x in reversed(xs):
            m.cached(x)
        for x, (out, total) in zip(xs, kept):
            ref_out, ref_total = m.fwd(x)
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(total, ref_total)


def test_storage_alias_views_the_same_memory_through_its_own_storage():
    from gearcache._torch import cuda_graphs as torch_cuda_graphs

    base = torch.arange(12.0)
    view = base[2:].view(2, 5)
    alias = torch_cuda_graphs.storage_alias(view)
    assert torch.equal(alias, view) and alias.stride() == view.stride() and alias.data_ptr() == view.data_ptr()
    assert alias.untyped_storage()._cdata != view.untyped_storage()._cdata
    base.add_(1)                                            # writes show through the alias
    assert torch.equal(alias, view)


@needs_cuda
def test_prefill_style_gears_over_the_sequence_dim_replay_equal_eager(tmp_path):
    """A prefill entry point: gears over the prompt length (dim 1), one graph per gear, outputs cut back to T."""
    torch.manual_seed(0)
    m = Step(tmp_path, _config(x={1: [4, 8, 16]})).cuda()
    with torch.inference_mode():
        before = counters.graph_captures
        for t in range(1, 17):
            x = torch.randn(2, t, 8, device="cuda")
            out, total = m.cached(x)
            ref, ref_total = m.fwd(x)
            assert out.shape == ref.shape and total.shape == (2, t)
            torch.testing.assert_close(out, ref)
            torch.testing.assert_close(total, ref_total)
        assert counters.graph_captures - before == 3


class Counted(torch.nn.Module):
    """State the graph updates in place, as transformers' StaticCache does: a cache written at a position counter,
    and the counter advanced (not idempotent: a warm-up run left in place would shift every later position)."""

    def __init__(self, cache_dir, config):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long))
        self.register_buffer("cache", torch.zeros(16, 8))
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):                                # x [B, 8]
        self.cache.index_copy_(0, self.pos, self.lin(x).sum(0, keepdim=True))
        self.pos.add_(1)
        return self.cache.cumsum(0)[self.pos - 1] + x


def _counted_pair(tmp_path, config):
    torch.manual_seed(0)
    served = Counted(tmp_path, config).cuda()
    twin = Counted(tmp_path / "twin", CompilerConfig()).cuda()
    twin.load_state_dict(served.state_dict())
    return served, twin


def _assert_state_equal(served, twin):
    torch.testing.assert_close(served.pos, twin.pos)
    torch.testing.assert_close(served.cache, twin.cache)


@needs_cuda
@pytest.mark.parametrize("capture", ["first_call", "warmup"])
def test_state_the_graph_advances_in_place_is_advanced_once_per_call(tmp_path, capture):
    """The warm-up run before a capture writes the module's state too (a position counter, a cache): it is restored,
    so outputs and state equal eager after every call, whether gears are captured at warm-up or at first call."""
    cfg = CompilerConfig(mode="reduce-overhead")
    cfg.inference_config.capture_graphs = capture
    served, twin = _counted_pair(tmp_path, cfg)
    with torch.inference_mode():
        if capture == "warmup":
            served.cached.warmup(torch.zeros(1, 8, device="cuda"))
            _assert_state_equal(served, twin)
        for _ in range(6):
            x = torch.randn(1, 8, device="cuda")
            torch.testing.assert_close(served.cached(x), twin.fwd(x))
            _assert_state_equal(served, twin)
        assert int(served.pos) == 6


class GearedCounted(Counted):
    """Counted's state under gears: every gear's warm-up run writes the same cache and counter (shared state)."""

    def fwd(self, x):                                # x [B, 8], B geared
        self.cache.index_copy_(0, self.pos, self.lin(x[:1]))
        self.pos.add_(1)
        return self.lin(x) + self.cache.sum(0)


@needs_cuda
def test_warmup_of_every_gear_leaves_state_shared_by_the_gears_as_it_was(tmp_path):
    """Each gear's warm-up run before its capture writes the same cache and counter: what the first run wrote must
    not be saved as the 'before' of the next gear, so after warmup() the state is the one the user had."""
    torch.manual_seed(0)
    served = GearedCounted(tmp_path, _config(x={0: [1, 2, 4]})).cuda()
    twin = GearedCounted(tmp_path / "twin", CompilerConfig()).cuda()
    twin.load_state_dict(served.state_dict())
    before = counters.graph_captures
    with torch.inference_mode():
        served.cached.warmup(torch.zeros(4, 8, device="cuda"))
        assert counters.graph_captures - before == 3
        _assert_state_equal(served, twin)
        for n in (1, 3, 4, 2, 1):
            x = torch.randn(n, 8, device="cuda")
            torch.testing.assert_close(served.cached(x), twin.fwd(x))
            _assert_state_equal(served, twin)
        assert int(served.pos) == 5


@needs_cuda
def test_state_replaced_after_capture_is_captured_again(tmp_path):
    """A graph holds the addresses of the state it read at capture; a buffer replaced by another tensor (a new KV
    cache bound to the module) makes the next call capture again, so the new tensor is the one read and written."""
    served, twin = _counted_pair(tmp_path, CompilerConfig(mode="reduce-overhead"))
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(1, 8, device="cuda")
            torch.testing.assert_close(served.cached(x), twin.fwd(x))
        old = served.cache
        served.cache = torch.zeros(16, 8, device="cuda")         # nn.Module.__setattr__: into _buffers
        twin.cache = torch.zeros(16, 8, device="cuda")
        served.register_buffer("pos", torch.tensor([3], device="cuda"))
        twin.register_buffer("pos", torch.tensor([3], device="cuda"))
        frozen = old.clone()
        with counters.expect(graph_captures=1, compiles=0):
            for _ in range(3):
                x = torch.randn(1, 8, device="cuda")
                torch.testing.assert_close(served.cached(x), twin.fwd(x))
                _assert_state_equal(served, twin)
        assert torch.equal(old, frozen), "the replaced cache is left alone"


class WritesAndAliases(torch.nn.Module):
    """Writes its input in place and returns a view of it: no run plan (torch's loader loads it)."""

    def __init__(self, cache_dir, config):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        x.mul_(2)
        return self.lin(x), x[:, :2]


@needs_cuda
def test_an_input_written_by_an_entry_without_a_run_plan_is_copied_back_not_refused(tmp_path):
    """The artifact's plan is refused (an output aliases the input), but its writer still read which inputs the
    graph writes: under CUDA graphs the unmarked input is copied back after each replay, equal to eager (it was
    refused: 'the method writes to its input 0 in place, and its entry has no run plan saying so')."""
    torch.manual_seed(0)
    m = WritesAndAliases(tmp_path, _config()).cuda()
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(2, 8, device="cuda")
            x_eager = x.clone()
            out, view = m.cached(x)
            ref, ref_view = m.fwd(x_eager)
            torch.testing.assert_close(out, ref)
            torch.testing.assert_close(view, ref_view)
            torch.testing.assert_close(x, x_eager)
    assert counters.graph_captures >= 1


class Scaled(torch.nn.Module):
    """A method with a scalar argument beside its tensor (as a served step's keep_last)."""

    def __init__(self, cache_dir):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir,
                                              config=CompilerConfig(mode="reduce-overhead"))

    def fwd(self, x, scale):
        return self.lin(x) * scale


@needs_cuda
def test_a_call_like_the_last_replays_its_graph_through_the_shortcut(tmp_path):
    """A call like the last one (its tensors' metadata and its scalars the same) replays the last call's graph through
    the dispatcher's shortcut, with no key and no graph look-up; another scalar, a reset of the graphs or a replaced
    weight takes the full path, as before."""
    torch.manual_seed(0)
    m = Scaled(tmp_path).cuda()
    cached, weight = m.cached, torch.nn.Parameter(torch.randn(8, 8, device="cuda"))
    with torch.inference_mode():
        def check(scale, shortcut):
            before, x = cached.shortcut_calls, torch.randn(2, 8, device="cuda")
            torch.testing.assert_close(cached(x, scale), m.fwd(x, scale))
            assert cached.shortcut_calls == before + shortcut, (scale, shortcut)
        check(2, 0)
        for _ in range(3):
            check(2, 1)
        check(3, 0)                               # another scalar: its own entry and graph
        check(3, 1)
        check(2.0, 0)                             # another type
        check(2.0, 1)
        with counters.expect(graph_captures=1, compiles=0):
            cached.graphs.reset()
            check(2.0, 0)
        check(2.0, 1)
        with counters.expect(graph_captures=1, compiles=0):
            m.lin.weight = weight                 # the graph holds the old one's address
            check(2.0, 0)
        check(2.0, 1)


@needs_cuda
def test_release_graphs_destroys_every_graph_even_one_still_referenced(tmp_path):
    """release_graphs() destroys each CUDA graph, not only its reference in the method: the last replayed graph and
    the dispatcher's shortcut still point at one (a graph that captured NCCL collectives and stays alive makes
    destroy_process_group wait forever: the TP=4 benchmark's start-only jobs hung there, 2026-11-27). The method
    captures again afterwards and still equals eager."""
    torch.manual_seed(0)
    m = Scaled(tmp_path).cuda()
    cached = m.cached
    with torch.inference_mode():
        for _ in range(3):                        # captured, replayed, then through the shortcut
            x = torch.randn(2, 8, device="cuda")
            torch.testing.assert_close(cached(x, 2), m.fwd(x, 2))
        assert cached.shortcut_calls >= 1
        held = [g.graph for g in cached.graphs.graphs.values()]
        assert len(held) == 1
        held[0].replay()                          # alive before
        assert gearcache.release_graphs() >= 1
        for graph in held:
            with pytest.raises(RuntimeError):
                graph.replay()                    # destroyed: torch refuses to replay it
        assert cached.graphs.replayed is None and not cached.graphs.graphs
        with counters.expect(graph_captures=1, compiles=0):
            for _ in range(2):
                x = torch.randn(2, 8, device="cuda")
                torch.testing.assert_close(cached(x, 2), m.fwd(x, 2))


def test_a_graph_shortcut_matcher_says_false_once_the_full_path_would_not_replay_that_graph():
    """graph_matcher (on CPU tensors: no graph is replayed): True for a call like the captured one; False once the graph
    is retired, a parameter it reads is replaced, its static-address input is another tensor or unmarked, or a copied
    input is now marked static (each a graph key or capture of its own on the full path)."""
    from gearcache.keys import guard_watch

    kv, x, params = mark_static_address(torch.zeros(4)), torch.ones(2), {"w": torch.nn.Parameter(torch.ones(2))}
    graphed = graphed_entry.GraphedEntry(None, None, [], [(1, torch.empty(2), 0.0)], [(0, kv.data_ptr())])
    graphed.state_watch = guard_watch.GuardWatch([(params, "w", params["w"])], [], [], guard_watch.ABSENT)
    check = graphed_entry.graph_matcher(lambda *args: True, graphed)
    assert check(kv, x)
    assert not check(torch.zeros(4), x)                             # unmarked
    assert not check(mark_static_address(torch.zeros(4)), x)        # another tensor, marked
    assert not check(kv, mark_static_address(torch.ones(2)))        # a copied input now static
    assert check(kv, torch.ones(2))                                 # another copied tensor: filled in
    params["w"] = torch.nn.Parameter(torch.ones(2))
    assert not check(kv, x)
    graphed.state_watch, graphed.retired = None, True
    assert not check(kv, x)
