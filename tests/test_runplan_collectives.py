"""runplan/collectives.py: which graphs communicate, and the stand-ins the compile-time check answers them with."""
import torch

from gearcache.runplan import collectives


def _graph(target) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(target, (x, "sum", "0")) if target is not None else x
    graph.output(graph.call_function(torch.ops.aten.relu.default, (y,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_communicates_finds_functional_collectives_only():
    assert collectives.communicates(_graph(torch.ops._c10d_functional.all_reduce.default))
    assert collectives.communicates(_graph(torch.ops._c10d_functional.all_reduce)), "Dynamo records the packet"
    assert not collectives.communicates(_graph(None)), "aten operators do not communicate"
    assert not collectives.communicates(_graph(torch.ops.aten.add.Tensor))


def test_stand_ins_answer_in_this_thread_and_record_the_group():
    x = torch.arange(4.0)
    with collectives.stand_in_collectives() as names:
        y = torch.ops._c10d_functional.all_reduce(x, "sum", "7")
        z = torch.ops._c10d_functional.all_gather_into_tensor(x, 3, "7")
        torch.ops._c10d_functional.wait_tensor(y)
    assert torch.equal(y, x) and z.shape == (12,) and torch.equal(z[4:8], x)
    assert names == {"7"}
