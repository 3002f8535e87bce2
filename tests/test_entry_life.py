"""compiling/entry_life.py: what an entry key reads of the module, and module tensors made to share memory."""
import pytest
import torch

import gearcache
from gearcache import counters

from gearcache.compiling.entry_life import module_state


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)


def test_module_tensors_sharing_memory_change_the_module_state_and_apart_add_nothing():
    torch.manual_seed(0)
    m = _Two()
    apart = module_state(m)
    assert not [r for r in apart if r[0] == "shares"], "nothing shared: the rows (and keys) of before"
    m.b = m.a
    shared = module_state(m)
    assert ["shares", "b.weight", "a.weight", 0, True] in shared and shared != apart
    m.b = torch.nn.Linear(4, 4)
    m.b.weight.data = m.a.weight.data
    data_alias = module_state(m)
    assert ["shares", "b.weight", "a.weight", 0, False] in data_alias and data_alias not in (apart, shared)
    m.b.weight.data = torch.randn(4, 4)                 # apart again
    assert module_state(m) == apart


def test_module_tensors_on_one_storage_are_keyed_by_both_offsets():
    """Buffers ``c = t[1:5]``, ``d = t[2:6]`` were keyed as ``c = t[0:4]``, ``d = t[2:6]`` (the row held ``d``'s
    offset only): the entry compiled for c at 0 served c at 1 and wrote t[0:4] (eager [40, 60, 80, 50], gearcache
    [40, 60, 40, 50]). The first one's offset is in the row where it is not 0 (rows of before kept)."""
    def rows(c_at):
        m = torch.nn.Module()
        t = torch.arange(8.)
        m.register_buffer("c", t[c_at:c_at + 4])
        m.register_buffer("d", t[2:6])
        return [r for r in module_state(m) if r[0] == "shares"]
    assert rows(0) == [["shares", "d", "c", 2, False]]
    assert rows(1) == [["shares", "d", "c", 2, False, 1]]


class _Counting(torch.nn.Module):
    """A block that counts its calls in a buffer it writes in place."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(4))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x) + self.calls


class _TwoCounting(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Counting(), _Counting()])
        self.register_buffer("buf", torch.zeros(4))
        self.register_buffer("count", torch.zeros(4))
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        for layer in self.layers:
            x = layer(x)
        self.count.add_(1)
        return x + self.buf + self.count


def _served_as_eager(m, x):
    """``m.cached(x)`` and every tensor of ``m`` after it, equal to the eager method's from the same state."""
    tensors = dict(m.named_buffers(remove_duplicate=False))
    before = {k: t.clone() for k, t in tensors.items()}
    want = m.fwd(x)
    want_state = {k: t.clone() for k, t in tensors.items()}
    for k, t in tensors.items():
        t.copy_(before[k])
    got = m.cached(x)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    for k, t in tensors.items():
        assert torch.equal(t, want_state[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("share", [
    lambda m: m.layers.__setitem__(1, m.layers[0]),                         # a shared block
    lambda m: setattr(m, "count", m.buf[:]),                                # a buffer that is a view of another
    lambda m: setattr(m.layers[1].calls, "data", m.layers[0].calls.data),   # a .data swap onto another's memory
], ids=["shared_block", "view_buffer", "data_alias"])
def test_module_tensors_made_to_share_memory_are_served_as_eager(tmp_path, share):
    """Module tensors the graph writes, made to share memory after the first call (or before a fresh object's
    first call, loading from the same store), are never served by the entry compiled with them apart (which read
    and wrote them apart: its outputs were off by a whole count, found 2026-11-27): their sharing is in the entry key,
    and a change of it drops the entry in this process."""
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.manual_seed(0)
        m = _TwoCounting(tmp_path)
        _served_as_eager(m, x)
        share(m)
        for _ in range(2):
            _served_as_eager(m, x)
        torch.manual_seed(0)
        fresh = _TwoCounting(tmp_path)
        share(fresh)
        with counters.expect(compiles=0):
            for _ in range(2):
                _served_as_eager(fresh, x)
