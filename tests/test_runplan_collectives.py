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


def test_standing_in_for_collectives_imports_no_compiler():
    """A warm process under a process group runs every gear's CUDA-graph warm-up with collectives stood in
    (gearcache/graphs/gear_threads.py): the dispatch mode must not import torch._dynamo or Inductor (seconds; torch
    wraps a mode's ``__torch_dispatch__`` in ``_disable_dynamo`` unless the mode opts out). A fresh process, so that
    nothing imported them before."""
    import os
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from gearcache.runplan.collectives import stand_in_collectives\n"
            "with stand_in_collectives():\n"
            "    y = torch.ones(2) + 1\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules), float(y.sum()))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "4.0"]
