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
