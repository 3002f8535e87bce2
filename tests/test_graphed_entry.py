"""A gear's CUDA graph (gearcache/graphs/graphed_entry.py): outputs that view an argument or a module tensor come back
as eager returns them, views of the caller's tensor (GPU: ``GEARCACHE_TEST_DEVICE`` aside, these need CUDA)."""
import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device)")


@needs_cuda
def test_outputs_viewing_an_argument_or_a_buffer_follow_later_writes_as_eager_cold_and_warm(tmp_path):
    """tests/scripts/run_graph_output_aliases.py, every ``graph_outputs`` mode: ``return x[1:], x * 2`` and
    ``return self.table[1:], x + 1`` came back as copies (``"copy"``), or the argument's view as a view of the graph's
    static copy of it (``"view"``): writes to ``x`` or ``table`` after the call did not show through them as in eager.
    Now each contiguous call equals eager before and after such writes, in the compiling process and in a fresh one
    (nothing compiled); a strided ``x`` (its view cannot be rebuilt over it) and a view as another dtype are refused
    with nothing written, or equal eager."""
    from conftest import Script

    cache = str(tmp_path / "cache")
    cold = Script("run_graph_output_aliases.py", cache).result()
    for report in (cold, warm := Script("run_graph_output_aliases.py", cache).result()):
        for case, results in report["calls"].items():
            if case.endswith("as_int"):
                assert all(r in (True, "refused") for r in results), (case, report)
            else:
                assert results[:3] == [True, True, True] and results[3] in (True, "refused"), (case, report)
    assert warm["compiles"] == 0, warm
