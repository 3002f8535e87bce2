"""Tiny models for the gear tests."""
import torch

from gearcache import cache_compile


class PairMLP(torch.nn.Module):
    """Row-wise: padding rows is safe. Returns a per-row output and a per-row sum."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x, y):
        h = self.lin(x * y + x)
        return h, h.sum(-1)


class Flip(torch.nn.Module):
    """A graph specialised on a module's bool attribute (``self.flip``): compiled for False, negated when True."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.flip = False
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        h = self.lin(x)
        return -h if self.flip else h


class Mixed(torch.nn.Module):
    """x and y meet (x + y: their batch dims must stay equal); z's length is independent."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x, y, z):
        return (x + y) * 2, z.sin()


class BatchSoftmax(torch.nn.Module):
    """Reduces over the batch dim: zero padding changes the result."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        return torch.softmax(x, dim=0)


# ------------------------------------------------------------------- padding (tests/test_padding*.py, run_padding.py)
class SeenRows(torch.nn.Module):
    """Writes its batch into a buffer through the batch size (``seen[:B]``): padding would write pad rows into it."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.register_buffer("seen", torch.arange(32, dtype=torch.float32).reshape(8, 4))
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        self.seen[: x.shape[0]].copy_(x)
        return x * 2


class Center(torch.nn.Module):
    """Subtracts the batch mean: reduces over the batch dim, whatever the pad value."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        h = self.lin(x)
        return h - h.mean(0)


class KVStep(torch.nn.Module):
    """A decode step: writes this step's key into a KV cache argument in place, then attends over the cache up to
    ``pos`` (a mask). Padding-safe along the batch: no row sees another."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)
        self.cached_setitem = cache_compile(self.fwd_setitem, cache_dir=cache_dir, config=config)

    def fwd(self, x, kv, pos):                                       # x [B, 1, 4], kv [B, T, 4], pos [1]
        k = self.lin(x)
        kv.index_copy_(1, pos, k)
        mask = torch.arange(kv.shape[1], device=kv.device) <= pos
        scores = (kv @ k.transpose(1, 2)).squeeze(-1).masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, -1).unsqueeze(-1) * kv).sum(1)

    def fwd_setitem(self, x, kv, pos):
        kv[:, pos] = self.lin(x)                                     # values and cache meet without a guard
        return kv.sum(1)


class RunningSum(torch.nn.Module):
    """Adds the batch's column sums to a buffer in place: exact under padding only with a pad value of 0."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        self.total.add_(x.sum(0))
        return self.total * 2


class BatchMin(torch.nn.Module):
    """Column minima over the batch, of a float and of an integer input: exact under padding only with the largest
    value of each dtype in the padded rows (+inf, iinfo(int64).max), which gearcache chooses."""

    def __init__(self, cache_dir, config=None):
        super().__init__()
        self.cached = cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x, ids):
        return x.amin(0), ids.min(0).values, (-x).amax(0)
