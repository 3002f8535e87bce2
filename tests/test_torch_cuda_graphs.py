"""gearcache/_torch/cuda_graphs.py on CPU tensors: what a graph replay's ``graph_outputs="copy"`` returns."""
import torch

from gearcache._torch.cuda_graphs import fresh_copies


def test_fresh_copies_equal_clones_in_memory_of_their_own_and_leave_other_values():
    dense = torch.randn(4, 6)
    ints = torch.arange(10)
    sliced = torch.randn(5, 7)[:, 2:5]          # not dense: copied contiguous, as clone() does
    transposed = torch.randn(3, 4).t()          # dense, other strides: kept, as clone() does
    values = [dense, None, 3, ints, sliced, transposed]
    out = fresh_copies(values)
    assert len(out) == len(values)
    for value, copy in zip(values, out):
        if not isinstance(value, torch.Tensor):
            assert copy is value
            continue
        assert torch.equal(copy, value) and copy.dtype == value.dtype
        assert copy.stride() == value.clone().stride()
        assert copy.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
    value_before = dense.clone()
    out[0].add_(1)                              # the copy is the caller's: writing it leaves the source
    assert torch.equal(dense, value_before)


def test_a_single_tensor_is_cloned():
    x = torch.randn(3)
    (copy,) = fresh_copies([x])
    assert torch.equal(copy, x) and copy.data_ptr() != x.data_ptr()
