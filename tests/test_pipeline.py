"""compiling/pipeline.py: a compile in the calling process leaves the process as eager would (compiles in-process)."""
import pytest
import torch

import gearcache
from gearcache import CompilerConfig, counters


class Noisy(torch.nn.Module):
    """Reads the global generator in its method: with Inductor's ``fallback_random`` the compiled code draws the
    same numbers as eager from the same seed."""

    def __init__(self, cache_dir):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        config = CompilerConfig(inductor_options={"fallback_random": True})
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir, config=config)

    def fwd(self, x):
        return self.lin(x) + torch.rand(2, 4)


def _seeded(fn, x, seed):
    torch.manual_seed(seed)
    out = fn(x)
    return out, torch.rand(3)           # the generator's state after the call, as numbers


def test_a_compiling_call_draws_the_numbers_eager_draws_and_leaves_the_generator_as_eager(tmp_path):
    """Writing the run plan runs the compiled graph once on the example inputs (``finish_artifact``): that run drew
    from the global generator, so the call that compiled got other random numbers than eager (and than a warm process)
    from the same seed, and the process's later draws moved too. The compile keeps the generators' states."""
    torch.manual_seed(0)
    m = Noisy(tmp_path)
    x = torch.randn(2, 4)
    with torch.no_grad():
        with counters.expect(compiles=1):
            got, got_after = _seeded(m.cached, x, 1)
        want, want_after = _seeded(m.fwd, x, 1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_after, want_after, rtol=0, atol=0)
        warm = Noisy(tmp_path)                      # loads, as a warm process does
        warm.load_state_dict(m.state_dict())
        with counters.expect(compiles=0, loads=1):
            loaded, loaded_after = _seeded(warm.cached, x, 1)
        torch.testing.assert_close(loaded, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(loaded_after, want_after, rtol=0, atol=0)


@pytest.mark.slow
def test_settling_a_background_compile_leaves_the_generator_as_it_was(tmp_path):
    """A background compile is settled in the serving process (``finish_artifact``: the run plan written from the
    example inputs, a run of the graph), by ``wait_for_background_compiles`` or by a later call of its key: it leaves
    the caller's generator where it was, and the compiled calls after it draw what eager draws."""
    torch.manual_seed(0)
    m = Noisy(tmp_path)
    m.cached = gearcache.cache_compile(m.fwd, cache_dir=str(tmp_path), config=CompilerConfig(
        on_new_signature="background", inductor_options={"fallback_random": True}))
    x = torch.randn(2, 4)
    with torch.no_grad():
        _seeded(m.cached, x, 1)                     # served eagerly while a worker compiles
        torch.manual_seed(2)
        assert gearcache.wait_for_background_compiles() == 1
        settled_after = torch.rand(3)
        torch.manual_seed(2)
        torch.testing.assert_close(settled_after, torch.rand(3), rtol=0, atol=0)
        with counters.expect(eager_calls=0):        # compiled from now on
            got, got_after = _seeded(m.cached, x, 3)
        want, want_after = _seeded(m.fwd, x, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_after, want_after, rtol=0, atol=0)


class _Linear(torch.nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cached = gearcache.cache_compile(self.fwd, cache_dir=cache_dir)

    def fwd(self, x):
        return self.lin(x).relu()


def test_inductor_freezing_is_a_clear_error(tmp_path):
    """``torch._inductor.config.freezing = True`` makes Inductor fold weights into the code, which torch's cache (and
    so a stored artifact) cannot hold: the compile failed with torch's "CompiledArtifact.save failed to save since
    there's no artifact to save". The error names the setting and the fix."""
    import torch._inductor.config as inductor_config

    m = _Linear(tmp_path).eval()
    with inductor_config.patch(freezing=True), torch.inference_mode(), \
            pytest.raises(RuntimeError, match=r"freezing=True.*Fix: "):
        m.cached(torch.randn(2, 8))
