"""The padding analysis (gearcache/gears/padding.py) on the symbolic traces of small methods: what it finds and what it
does not. Only Dynamo traces run here (no compile)."""
import json

import pytest
import torch
import torch.nn.functional as F

from gear_models import Center, KVStep, RunningSum, SeenRows
from gearcache import ConfigError
from gearcache.call import signature
from gearcache.compiling.symbolic_trace import symbolic_shapes
from gearcache.gears import padding
from gearcache.gears.padding_report import PaddingReport
from gearcache.gears.plan import MarkedDim, build_plan


def _report(method, args, marked, names=None):
    """The padding report of ``method`` called with ``args``, the (leaf, dim) pairs ``marked`` padded."""
    leaves, key = signature.call_key(args, {})
    with torch.no_grad():
        trace = symbolic_shapes(method, method.__self__, key[0], leaves, marked)
    return padding.analyse(trace, names or {}, {leaf for leaf, _ in marked}), trace


class Ops(torch.nn.Module):
    """One method per pattern; x is [B, 4] (B padded) unless a method says otherwise."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm1d(4)
        self.emb = torch.nn.Embedding(10, 4)
        self.register_buffer("table", torch.zeros(10, 4))
        self.register_buffer("types", torch.zeros(1, 8, dtype=torch.long))

    # ------------------------------------------------------------------------------------------ safe along B
    def rowwise(self, x):
        h = self.ln(self.lin(x)).relu()
        return h * 2, h.sum(-1), x[:, 0], h.t().t() + 1

    def merged_reshape(self, x):                # x [B, T, 4]: B*T rows through a 2-D matmul and back
        b, t, d = x.shape
        h = self.lin(x.reshape(b * t, d)).view(b, t, d)
        return h.transpose(0, 1).reshape(t, b * d).view(t, b, d).transpose(0, 1)

    def causal_attention(self, x):              # x [1, T, 4], T padded: a real query never sees a later pad key
        q = x[:, None]
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def lookups(self, ids):                     # ids [B] padded
        pos = torch.arange(ids.shape[0])
        return self.emb(ids) + pos[:, None], self.table[ids]

    def buffered_lookup(self, ids):             # ids [B, 3]: a buffer's row expanded over the batch, as an index
        types = self.types[:, : ids.shape[1]].expand(ids.shape[0], -1)     # (BERT's token_type_ids)
        return self.emb(ids) + self.emb(types) * 2

    def mask_by_batch_index(self, mask):        # mask [B, 5]: transformers' padding_mask[batch_idx, kv_idx]
        b = torch.arange(mask.shape[0])[:, None]
        k = torch.arange(mask.shape[1])[None, :]
        return mask[b, k].float() * 2

    def conv_over_batch(self, x):               # x [B, 4, 8]: B padded
        return self.bn(self.conv(x)).mean(-1)

    # --------------------------------------------------------- exact along B with a neutral pad (pad_values)
    def amin(self, x):
        return x.amin(0)

    def amax(self, x):
        return x.amax(0, keepdim=True) + x

    def negated_amin(self, x):                  # -x holds -pad: x needs -inf
        return (-x).amin(0)

    def int_min(self, ids):                     # ids [B, 2] int64
        return ids.min(0).values

    def argmax(self, x):
        return x.argmax(0)

    def scaled_sum(self, x):
        return (x * 2).sum(0)

    def shifted_prod(self, x):                  # 0 * 0.5 + 1 = 1 before the product
        return (x * 0.5 + 1).prod(0)

    def softmax(self, x):
        return torch.softmax(x, 0)

    def logsumexp(self, x):
        return x.logsumexp(0)

    def gram(self, x):                          # contracts B: 0 * 0 in the padded terms
        return x.t() @ x

    def cumsum(self, x):                        # padding comes after every real row
        return x.cumsum(0)

    def masked_min(self, x, valid):             # the user masks the pad rows: any pad of x is fine
        return x.masked_fill(~valid, float("inf")).amin(0)

    def lookups_and_sum(self, ids, x):          # ids as an index (pad 0 valid), x summed (pad 0)
        return self.emb(ids).sum(-1) + x.sum(0).sum()

    def fresh_rows(self, x):                    # padded rows write 0 where eager's rows hold 0
        buf = torch.zeros(8, 4)
        buf[: x.shape[0]] = x
        return buf * 2

    def cache_prefill(self, ids, kv):           # ids [T], kv [16, 4]: a padded position keeps its slot's old entry
        pos = torch.arange(ids.shape[0])
        real = (ids >= 0)[:, None]
        new = self.emb(ids.clamp(min=0))
        return kv.index_copy(0, pos, torch.where(real, new, kv.index_select(0, pos)))

    # -------------------------------------------------------------------------------------- mixing along B
    def fresh_rows_shifted(self, x):            # padded rows write 1 where eager's rows hold 0
        buf = torch.zeros(8, 4)
        buf[: x.shape[0]] = x + 1
        return buf

    def cache_prefill_overwrites(self, ids, kv):    # the padded positions' embeddings land in their slots
        pos = torch.arange(ids.shape[0])
        return kv.index_copy(0, pos, self.emb(ids.clamp(min=0)))

    def mask_by_other_rows(self, mask):         # row i reads row i % 2: a padded row is read by a real one
        return mask[torch.arange(mask.shape[0]) % 2].float()

    def mean(self, x):
        return x - x.mean(0)

    def linear_then_sum(self, x):               # lin's pad rows hold its bias: no pad of x makes them 0
        return self.lin(x).sum(0)

    def min_and_max(self, x):                   # +inf for one, -inf for the other: no one pad serves both
        return x.amin(0) + x.amax(0)

    def index_and_min(self, ids):               # an index needs 0, the min needs the largest int64
        return self.emb(ids).sum() + ids.min()

    def partly_overwritten(self, x):            # column 0 of the pad rows holds 5 after the write, the rest the pad
        y = x.clone()
        y[:, 0] = 5.0
        return y.amin(0)

    def sort(self, x):
        return x.sort(0).values

    def merged_cumsum(self, x):                 # x [B, 3]: B inside the merged dim, pads before real rows there
        return x.t().reshape(-1).cumsum(0).view(3, -1).t()

    def last_row(self, x):
        return x[-1]

    def size_as_value(self, x):
        return x * x.shape[0]

    def cat_along(self, x):                     # the padded rows end up between real ones
        return torch.cat([x, x[:1]], 0).sum(0)

    def masked_attention(self, x):              # x [1, T, 4], T padded, an explicit mask: pad keys are seen
        q = x[:, None]
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    def scrambled_reshape(self, x):             # x [B, 3]: rows of B move inside a merged dim
        return x.t().reshape(-1, 3).sum(-1)

    def branch(self, x):
        return x * 2 if x.shape[0] > 3 else x * 3

    def unknown_op(self, x):
        return torch.fft.fft(x, dim=-1).real

    def conv_along(self, x):                    # x [2, 4, L]: L padded
        return self.conv(x)

    # --------------------------------------------------------------------------------------------- writes
    def write_unmarked_input(self, x, cache):
        cache[: x.shape[0]] = x
        return x + 1

    def write_at_padded_positions(self, ids, values):
        self.table.index_put_((ids,), values)
        return values * 2

    def train_batch_norm(self, x):              # x [B, 4, 8]: the running statistics take in the pad rows
        bn = self.bn                            # batch norm as in training, the module left as it is (eval)
        return torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, training=True)


OPS = Ops().eval()


@pytest.mark.parametrize("method, args, marked", [
    ("rowwise", (torch.randn(4, 4),), [(0, 0)]),
    ("merged_reshape", (torch.randn(4, 3, 4),), [(0, 0)]),
    ("merged_reshape", (torch.randn(2, 5, 4),), [(0, 1)]),
    ("causal_attention", (torch.randn(1, 6, 4),), [(0, 1)]),
    ("lookups", (torch.randint(0, 10, (4,)),), [(0, 0)]),
    ("buffered_lookup", (torch.randint(0, 10, (4, 3)),), [(0, 0)]),
    ("mask_by_batch_index", (torch.ones(4, 5, dtype=torch.bool),), [(0, 0)]),
    ("conv_over_batch", (torch.randn(4, 4, 8),), [(0, 0)]),
])
def test_ops_that_keep_padded_rows_apart_are_not_flagged(method, args, marked):
    report, _ = _report(getattr(OPS, method), args, marked)
    assert report.complete
    assert report.mixing == [] and report.unsafe_writes == []


@pytest.mark.parametrize("method, args, pads", [
    ("amin", (torch.randn(4, 4),), {0: float("inf")}),
    ("amax", (torch.randn(4, 4),), {0: float("-inf")}),
    ("negated_amin", (torch.randn(4, 4),), {0: float("-inf")}),
    ("int_min", (torch.randint(0, 9, (4, 2)),), {0: torch.iinfo(torch.int64).max}),
    ("argmax", (torch.randn(4, 4),), {0: float("-inf")}),
    ("scaled_sum", (torch.randn(4, 4),), {0: 0.0}),
    ("shifted_prod", (torch.randn(4, 4),), {0: 0.0}),
    ("softmax", (torch.randn(4, 4),), {0: float("-inf")}),
    ("logsumexp", (torch.randn(4, 4),), {0: float("-inf")}),
    ("gram", (torch.randn(4, 4),), {0: 0.0}),
    ("cumsum", (torch.randn(4, 4),), {0: 0.0}),
    ("masked_min", (torch.randn(4, 4), torch.ones(4, 4, dtype=torch.bool)), {0: 0.0, 1: False}),
    ("lookups_and_sum", (torch.randint(0, 10, (4,)), torch.randn(4, 4)), {0: 0, 1: 0.0}),
])
def test_reductions_over_a_padded_dim_are_exact_with_the_pad_value_chosen_for_them(method, args, pads):
    """Each padded input gets the first candidate (0, -inf, +inf, 1; for integers 0, smallest, largest, 1) for which
    every op reading its padded rows is exact; the pad is followed exactly through pointwise ops."""
    report, _ = _report(getattr(OPS, method), args, [(i, 0) for i in range(len(args))])
    assert report.complete and report.mixing == [] and report.unsafe_writes == [], report.mixing
    assert report.pad_values == pads


def test_a_pad_value_the_user_gave_is_kept_and_a_plan_it_makes_inexact_names_what_it_needs():
    leaves, key = signature.call_key((torch.randn(4, 4),), {})
    with torch.no_grad():
        trace = symbolic_shapes(OPS.amin, OPS, key[0], leaves, [(0, 0)])
    report = padding.analyse(trace, {0: "x"}, {0}, {0: 0.0})
    assert report.pad_values == {0: 0.0}
    (f,) = report.mixing
    assert f.op == "aten.amin.default" and "return x.amin(0)" in f.where
    assert "exact only if its padded rows hold +inf, but they hold 0" in f.why
    assert padding.analyse(trace, {0: "x"}, {0}, {0: float("inf")}).mixing == []


def test_rows_written_through_the_padded_size_into_a_tensor_the_method_makes():
    """``buf[:B] = x`` into a ``buf`` of 8 rows: the padded rows land on rows eager leaves alone. Exact when they
    write what those rows hold (x padded with 0 over zeros); mixing otherwise (before, served: rows 3 of a call of 3
    rows padded to 4 held 1 where eager has 0)."""
    report, _ = _report(OPS.fresh_rows, (torch.randn(4, 4),), [(0, 0)])
    assert report.mixing == [] and report.pad_values == {0: 0.0}
    report, _ = _report(OPS.fresh_rows_shifted, (torch.randn(4, 4),), [(0, 0)])
    (f,) = report.mixing
    assert f.op == "aten.copy_.default" and "buf[: x.shape[0]] = x + 1" in f.where
    assert "writes padding rows into rows that are real in the tensor it writes (they hold 1 there; eager leaves 0)" \
        in f.why


@pytest.mark.parametrize("bound, exact", [(8, True), (32, False)])
def test_a_cache_update_that_keeps_old_entries_at_padded_positions_is_exact(bound, exact):
    """examples/hf_llama.py's prefill pattern: positions ``arange(T)`` (padded rows: positions after every real one,
    below the largest gear), the padded rows write back ``kv.index_select(0, pos)``: what their slots hold. gearcache
    pads the ids with int64's smallest value, so ``ids >= 0`` is False there. With a largest gear past the cache's 16
    slots the padded positions could index out of range: refused."""
    args = (torch.randint(0, 10, (6,)), torch.randn(16, 4))
    leaves, key = signature.call_key(args, {})
    with torch.no_grad():
        trace = symbolic_shapes(OPS.cache_prefill, OPS, key[0], leaves, [(0, 0)])
    report = padding.analyse(trace, {0: "ids", 1: "kv"}, {0}, bounds={trace.symbols[0]: bound})
    if exact:
        assert report.mixing == [] and report.pad_values == {0: torch.iinfo(torch.int64).max * -1 - 1}
    else:
        assert any("not a valid position" in f.why and "below 32" in f.why for f in report.mixing), report.mixing
    with torch.no_grad():
        trace = symbolic_shapes(OPS.cache_prefill_overwrites, OPS, key[0], leaves, [(0, 0)])
    (f,) = padding.analyse(trace, {0: "ids", 1: "kv"}, {0}, bounds={trace.symbols[0]: 8}).mixing
    assert f.op == "aten.index_copy.default" and "writes at positions taken from padded rows" in f.why


def test_an_index_needs_a_pad_that_is_a_valid_position():
    leaves, key = signature.call_key((torch.randint(0, 10, (4,)), torch.randn(4, 4)), {})
    with torch.no_grad():
        trace = symbolic_shapes(OPS.lookups_and_sum, OPS, key[0], leaves, [(0, 0), (1, 0)])
    report = padding.analyse(trace, {0: "ids", 1: "x"}, {0, 1}, {0: -1})
    (f,) = report.mixing
    assert f.op == "aten.embedding.default" and "self.emb(ids)" in f.where
    assert "reads positions from padded rows that hold -1, which is not a valid position (0 to 10 - 1)" in f.why


@pytest.mark.parametrize("method, args, marked, op, why", [
    ("mean", (torch.randn(4, 4),), [(0, 0)], "aten.mean.dim", "a mean divides by the padded count"),
    ("linear_then_sum", (torch.randn(4, 4),), [(0, 0)], "aten.sum", "exact only if its padded rows hold 0, but they "
                                                                    "hold values gearcache cannot tell"),
    ("min_and_max", (torch.randn(4, 4),), [(0, 0)], "aten.am", "exact only if its padded rows hold"),
    ("index_and_min", (torch.randint(0, 10, (4,)),), [(0, 0)], "aten.", "padded rows"),
    ("partly_overwritten", (torch.randn(4, 4),), [(0, 0)], "aten.amin", "exact only if its padded rows hold +inf"),
    ("sort", (torch.randn(4, 4),), [(0, 0)], "aten.sort", "sorts or ranks along a padded dim"),
    ("merged_cumsum", (torch.randn(4, 3),), [(0, 0)], "aten.cumsum", "merges a padded dim inside others"),
    ("last_row", (torch.randn(4, 4),), [(0, 0)], "aten.select", "other than the first"),
    ("mask_by_other_rows", (torch.ones(4, 5, dtype=torch.bool),), [(0, 0)], "aten.index", "into a padded dim"),
    ("size_as_value", (torch.randn(4, 4),), [(0, 0)], "aten.mul", "size of a padded dim as a value"),
    ("cat_along", (torch.randn(4, 4),), [(0, 0)], "aten.cat", "concatenates along a padded dim"),
    ("masked_attention", (torch.randn(1, 6, 4),), [(0, 1)], "scaled_dot_product", "padded key dim"),
    ("scrambled_reshape", (torch.randn(4, 3),), [(0, 0)], "view", "no longer line up"),
    ("branch", (torch.randn(4, 4),), [(0, 0)], "(size guard)", "branches on the size of a padded dim"),
    ("unknown_op", (torch.randn(4, 4),), [(0, 0)], "fft", "assumed to mix"),
    ("conv_along", (torch.randn(2, 4, 8),), [(0, 2)], "aten.convolution", "neighbouring rows"),
])
def test_ops_that_mix_padded_rows_in_are_found_with_op_and_reason(method, args, marked, op, why):
    report, _ = _report(getattr(OPS, method), args, marked)
    assert report.unsafe_writes == []
    assert report.mixing, f"{method}: nothing found"
    f = report.mixing[0]
    assert op in f.op and why in f.why, str(f)
    assert f.reaches in ("output 0", "every output")


def test_a_finding_names_the_users_source_line_and_what_it_reaches(tmp_path):
    m = Center(tmp_path)
    report, _ = _report(m.fwd, (torch.randn(4, 4),), [(0, 0)])
    (f,) = report.mixing
    assert f.op == "aten.mean.dim" and f.reaches == "output 0"
    assert f.where.startswith("gear_models.py:") and "in fwd: return h - h.mean(0)" in f.where
    assert "aten.mean.dim at gear_models.py:" in str(f)


def test_writes_through_a_padded_extent_into_state_are_unsafe(tmp_path):
    m = SeenRows(tmp_path)
    report, _ = _report(m.fwd, (torch.randn(4, 4),), [(0, 0)])
    (f,) = report.unsafe_writes
    assert f.op == "aten.copy_.default" and f.reaches == "parameter or buffer seen"
    assert "self.seen[: x.shape[0]].copy_(x)" in f.where and "writes through a padded dim" in f.why
    assert report.written_state == ["seen"] and report.mixing == []


@pytest.mark.parametrize("method, args, marked, names, reaches, why", [
    ("write_unmarked_input", (torch.randn(4, 4), torch.zeros(8, 4)), [(0, 0)], {0: "x", 1: "cache"},
     "argument cache", "through a padded dim"),
    ("write_at_padded_positions", (torch.randint(0, 10, (4,)), torch.randn(4, 4)), [(0, 0), (1, 0)], {},
     "parameter or buffer table", "with a padded tensor"),
    ("train_batch_norm", (torch.randn(4, 4, 8),), [(0, 0)], {}, "parameter or buffer bn.running_mean",
     "with a padded tensor"),
])
def test_other_unsafe_writes(method, args, marked, names, reaches, why):
    try:
        report, _ = _report(getattr(OPS, method), args, marked, names)
    finally:
        OPS.eval()
    assert any(f.reaches == reaches and why in f.why for f in report.unsafe_writes), report.unsafe_writes


def test_state_updated_with_a_sum_over_padded_rows_is_exact_with_pad_0_and_mixing_with_another(tmp_path):
    m = RunningSum(tmp_path)
    report, trace = _report(m.fwd, (torch.randn(4, 4),), [(0, 0)])
    assert report.unsafe_writes == [] and report.written_state == ["total"]
    assert report.mixing == [] and report.pad_values == {0: 0.0}
    ones = padding.analyse(trace, {0: "x"}, {0}, {0: 1.0})
    assert {f.reaches for f in ones.mixing} == {"parameter or buffer total", "output 0"}
    assert all(f.op == "aten.sum.dim_IntList" and "hold 0, but they hold 1" in f.why for f in ones.mixing)


def test_a_padded_input_written_in_place_is_recorded_for_copy_back(tmp_path):
    m = KVStep(tmp_path)
    args = (torch.randn(4, 1, 4), torch.zeros(4, 6, 4), torch.tensor([2]))
    report, _ = _report(m.fwd, args, [(0, 0), (1, 0)], {0: "x", 1: "kv", 2: "pos"})
    assert report.complete and report.mixing == [] and report.unsafe_writes == []
    assert report.written_leaves == [1] and report.meets == []


def test_dims_that_meet_without_a_guard_move_in_lockstep(tmp_path):
    """``kv[:, pos] = values``: Dynamo traces no guard that values and cache have one batch size. The analysis takes
    them as one (``meets``) and the plan refuses calls where they differ, instead of broadcasting one row."""
    m = KVStep(tmp_path)
    args = (torch.randn(4, 1, 4), torch.zeros(4, 6, 4), torch.tensor([2]))
    report, trace = _report(m.fwd_setitem, args, [(0, 0), (1, 0)])
    assert report.mixing == [] and report.written_leaves == [1]
    assert len(report.meets) == 1 and set(report.meets[0]) == set(trace.symbols)
    marks = [MarkedDim(0, 0, [2, 4], "x"), MarkedDim(1, 0, [2, 4], "kv")]
    plan = build_plan(marks, "zip", "error", trace.symbols, trace.output_dims, report)
    assert plan.lockstep == [[0, 1]]
    assert plan.targets((torch.zeros(3, 1, 4), torch.zeros(3, 6, 4))) == [4, 4]
    with pytest.raises(ConfigError, match="x dim 0 = 1, kv dim 0 = 3"):
        plan.targets((torch.zeros(1, 1, 4), torch.zeros(3, 6, 4)))
    product = build_plan(marks, "product", "error", trace.symbols, trace.output_dims, report)
    assert product.groups == [[0, 1]]


def test_report_round_trips_through_json(tmp_path):
    report, _ = _report(SeenRows(tmp_path).fwd, (torch.randn(4, 4),), [(0, 0)])
    assert PaddingReport.from_json(report.to_json()) == report
    chosen, _ = _report(OPS.amin, (torch.randn(4, 4),), [(0, 0)])
    again = PaddingReport.from_json(json.loads(json.dumps(chosen.to_json())))
    assert again == chosen and again.pad_values == {0: float("inf")}


def test_a_graph_that_cannot_be_analysed_counts_as_mixing_and_writing_everything(tmp_path):
    m = RunningSum(tmp_path)
    _, trace = _report(m.fwd, (torch.randn(4, 4),), [(0, 0)])
    for node in trace.graph.graph.find_nodes(op="placeholder"):
        node.meta.pop("example_value")              # no fake inputs: the ATen retrace cannot run
    report = padding.analyse(trace, {}, {0})
    assert not report.complete
    (f,) = report.mixing
    assert "could not be analysed" in f.why and f.reaches == "every output"
    assert report.written_leaves == [0] and report.written_state == ["total"]


def test_a_padded_size_the_aten_lowering_specializes_is_refused_not_read_as_static(monkeypatch):
    """torch 2.11's lowering of a 3-D matmul (make_fx under the trace's fake mode) fixes the batch size to the
    example's number: the ATen graph then holds ``expand(view, [4, 4, 4])`` and a walk of it reads the padded dim as
    static, proving a sum over it exact (served wrong on an H100: a buffer's padded row written, a sum taking the
    padding rows in). Here the lowering is made to specialize the size as 2.11's does: the analysis must refuse."""
    from gearcache._torch import aten as torch_aten

    lower = torch_aten.aten_graph

    def specializing(gm, decompositions=None):
        aten = lower(gm, decompositions)
        fake = next(iter(gm.graph.find_nodes(op="placeholder", target="L_x_"))).meta["example_value"]
        int(fake.shape[0])                      # what 2.11's matmul does to the size: guard it to the example's
        return aten

    monkeypatch.setattr(torch_aten, "aten_graph", specializing)
    report, _ = _report(OPS.rowwise, (torch.randn(4, 4),), [(0, 0)])
    assert report.mixing and any("size" in f.op for f in report.mixing), report
    monkeypatch.undo()
    report, _ = _report(OPS.rowwise, (torch.randn(4, 4),), [(0, 0)])
    assert report.mixing == [], "the same method, lowered without specializing, is proved exact"


def test_every_op_has_its_rule_in_one_family_only():
    """The rules table (padding_rules.py) gathers one table per op family: an op two families claimed would take
    whichever came last, silently."""
    from gearcache.gears import (padding_rules, padding_rules_collectives, padding_rules_contractions,
                                 padding_rules_elementwise, padding_rules_indexing, padding_rules_reductions,
                                 padding_rules_views)

    families = [padding_rules_elementwise, padding_rules_views, padding_rules_reductions, padding_rules_contractions,
                padding_rules_indexing, padding_rules_collectives]
    names = [name for family in families for name in family.RULES]
    assert len(names) == len(set(names)) == len(padding_rules.RULES)
