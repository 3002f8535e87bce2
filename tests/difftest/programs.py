"""The program grammar: ``nn.Module`` classes written as Python source from a JSON-able spec.

A program is a module file ``<name>.py`` holding one class ``Prog`` whose method ``fwd`` starts with
``h = self.lin(x)`` and applies a list of **blocks**, then returns one of the **output** shapes below; and, when a
block reads one, a helper file ``<helper>.py`` with constants and a function the method calls. Sources are files (not
``exec`` strings) so a fresh process imports the same method from the same path, and so a constant can be *edited*
between the compiling and the loading process: :func:`render` takes the constants' values.

A program spec (JSON)::

    {"module": "dtp_3", "helper": "dth_3", "blocks": ["layernorm", "gelu", "buf_rows"], "output": "nested"}

Sizes are fixed: features ``D = 16``, buffers and the persistent ``cache`` input have ``ROWS = 8`` rows; the batch
``B`` (dim 0 of every per-call input) is the dim gears pad.
"""
from __future__ import annotations

import dataclasses

D = 16
ROWS = 8


@dataclasses.dataclass(frozen=True)
class Block:
    """One step of ``fwd``. ``attrs``/``consts``/``helper_consts``: name -> pool of values, the first the default
    (``consts``: globals of the program file; ``helper_consts``: of the helper file). ``tags``: features counted in the
    coverage report."""
    body: tuple[str, ...]
    init: tuple[str, ...] = ()
    attrs: dict = dataclasses.field(default_factory=dict)
    consts: dict = dataclasses.field(default_factory=dict)
    helper_consts: dict = dataclasses.field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()           # more methods of the class (source lines at class level)
    closure: dict = dataclasses.field(default_factory=dict)    # variables of the factory the class is built in


BLOCKS: dict[str, Block] = {
    "linear": Block(("h = self.lin2(h)",), ("self.lin2 = torch.nn.Linear(16, 16)",), tags=("op:matmul",)),
    "layernorm": Block(("h = self.norm(h)",), ("self.norm = torch.nn.LayerNorm(16, eps=eps)",),
                       attrs={"eps": (1e-5, 1e-1)}, tags=("attr:submodule", "op:layer_norm")),
    "gelu": Block(("h = F.gelu(h * 3, approximate=self.approx)",), ("self.approx = approx",),
                  attrs={"approx": ("none", "tanh")}, tags=("attr:str",)),
    "heads": Block(("q = h.reshape(h.shape[0], self.heads, 16 // self.heads)",
                    "a = torch.softmax(q @ q.transpose(1, 2), dim=-1)",
                    "h = (a @ q).reshape(h.shape[0], 16)"),
                   ("self.heads = heads",), attrs={"heads": (4, 8)}, tags=("attr:int", "op:softmax", "op:view")),
    "act": Block(("if self.act == 'relu':", "    h = torch.relu(h)", "elif self.act == 'tanh':",
                  "    h = torch.tanh(h)", "else:", "    h = F.silu(h)"),
                 ("self.act = act",), attrs={"act": ("relu", "tanh", "silu")}, tags=("attr:enum",)),
    "residual": Block(("if self.residual:", "    h = h + x"), ("self.residual = residual",),
                      attrs={"residual": (True, False)}, tags=("attr:bool",)),
    "scale": Block(("h = h * self.scale",), ("self.scale = scale",), attrs={"scale": (2.0, 0.5)},
                   tags=("attr:float",)),
    "roll": Block(("h = torch.roll(h, self.shifts[0], -1) - torch.roll(h, self.shifts[1], -1)",),
                  ("self.shifts = tuple(shifts)",), attrs={"shifts": ((1, 3), (2, 5))}, tags=("attr:tuple",)),
    "global_scale": Block(("h = h * SCALE",), consts={"SCALE": (1.0, 3.0)}, tags=("const:global",)),
    "helper_fn": Block(("h = helper.mix(h)",), helper_consts={"ALPHA": (0.1, 0.7)}, tags=("const:helper-file",)),
    "helper_const": Block(("h = h + SHIFT",), helper_consts={"SHIFT": (0.5, -1.0)},
                          tags=("const:helper-file", "const:imported")),
    "feature_mean": Block(("h = h - h.mean(-1, keepdim=True)",), tags=("op:reduce",)),
    "gear_mean": Block(("h = h - h.mean(0, keepdim=True)",), tags=("op:reduce-gear-dim",)),
    "gear_softmax": Block(("h = torch.softmax(h, dim=0)",), tags=("op:reduce-gear-dim", "op:softmax")),
    "gear_cumsum": Block(("h = h.cumsum(0) * 0.5",), tags=("op:scan-gear-dim",)),
    "buf_count": Block(("self.calls.add_(1)", "h = h + self.calls"), ("self.register_buffer('calls', torch.zeros(1))",),
                       tags=("inplace:buffer",)),
    "buf_rows": Block(("self.seen[: h.shape[0]].copy_(h)",), ("self.register_buffer('seen', torch.zeros(8, 16))",),
                      tags=("inplace:buffer", "inplace:gear-dim")),
    "buf_acc": Block(("self.acc.add_(h.sum(0))",), ("self.register_buffer('acc', torch.zeros(16))",),
                     tags=("inplace:buffer", "op:reduce-gear-dim")),
    "state_inplace": Block(("state.mul_(0.5).add_(h)", "h = h + state"), inputs=("state",), tags=("inplace:input",)),
    "x_inplace": Block(("x.mul_(2)", "h = h + x"), tags=("inplace:input",)),
    "cache_write": Block(("cache[: h.shape[0]].copy_(h)", "h = h + cache[: h.shape[0]] * 0.5"), inputs=("cache",),
                         tags=("inplace:input", "inplace:gear-dim", "input:persistent")),
    "bf16_input": Block(("h = h + y.float()",), inputs=("y",), tags=("dtype:bfloat16",)),
    "ids_input": Block(("h = h + self.emb(ids)",), ("self.emb = torch.nn.Embedding(10, 16)",), inputs=("ids",),
                       tags=("dtype:int64",)),
    "alpha_scalar": Block(("h = h * alpha",), inputs=("alpha",), tags=("input:float-scalar",)),
    "int_scalar": Block(("h = torch.roll(h, n, -1)",), inputs=("n",), tags=("input:int-scalar",)),
    "mask_opt": Block(("if mask is not None:", "    h = h * mask"), inputs=("mask",), tags=("input:optional",)),
    # value guards (issue #35): a method of the class (patched on the class or the instance), an attribute the method
    # reads with a default (set after the first call), a variable of the factory the class is built in (``fwd``'s
    # closure, rebound by ``nonlocal``)
    "helper_method": Block(("h = self.helper(h)",), methods=("def helper(self, h):", "    return h * 1.5 + 0.25"),
                           tags=("method:class",)),
    "opt_attr": Block(("h = h * getattr(self, 'extra', 1.0)",), tags=("attr:optional",)),
    "closure_scale": Block(("h = h * CSCALE",), closure={"CSCALE": (2.0, 5.0)}, tags=("closure:method",)),
}

# Reductions over the geared dim of the inputs themselves, exact under padding only with a pad value neutral for them
# (gearcache/gears/padding.py chooses it: +inf before a min, -inf before a max or softmax, 0 before a sum...), through
# negated and scaled inputs and integer ones; a mean, exact with none. Their cases' later calls hold data that shows
# a wrong pad (all positive after mixed signs: draw.py, "data"), which one checked first call would not.
PAD_BLOCKS: dict[str, Block] = {
    "pad_amin": Block(("h = h + x.amin(0, keepdim=True)",), tags=("op:reduce-gear-dim", "pad:neutral")),
    "pad_amax": Block(("h = h + x.amax(0, keepdim=True)",), tags=("op:reduce-gear-dim", "pad:neutral")),
    "pad_neg_min": Block(("h = h - (x * -2.0).amin(0, keepdim=True)",),
                         tags=("op:reduce-gear-dim", "pad:neutral", "pad:negated")),
    "pad_argmax": Block(("h = h + x.argmax(0, keepdim=True).float()",), tags=("op:reduce-gear-dim", "pad:neutral")),
    "pad_sum": Block(("h = h + (x * 0.5).sum(0, keepdim=True)",), tags=("op:reduce-gear-dim", "pad:neutral")),
    "pad_prod": Block(("h = h * (x * 0.1 + 1.0).prod(0, keepdim=True)",),
                      tags=("op:reduce-gear-dim", "pad:neutral", "pad:scaled")),
    "pad_softmax": Block(("h = h * torch.softmax(x, 0)",), tags=("op:reduce-gear-dim", "pad:neutral")),
    "pad_logsumexp": Block(("h = h + x.logsumexp(0, keepdim=True)",), tags=("op:reduce-gear-dim", "pad:neutral")),
    "pad_mean": Block(("h = h + x.mean(0, keepdim=True)",), tags=("op:reduce-gear-dim", "pad:never-neutral")),
    "ids_min": Block(("h = h + ids.amin(0).float()",), inputs=("ids",),
                     tags=("op:reduce-gear-dim", "pad:neutral", "dtype:int64", "pad:int")),
    "ids_max": Block(("h = h - ids.amax(0).float()",), inputs=("ids",),
                     tags=("op:reduce-gear-dim", "pad:neutral", "dtype:int64", "pad:int")),
    # rows [:B] of a tensor the method makes, then all 8 rows summed: the padded rows land on rows eager leaves zero
    "fresh_rows": Block(("rows = torch.zeros(8, 16, device=x.device)", "rows[: x.shape[0]] = x",
                         "h = h + rows.sum(0, keepdim=True)"), tags=("op:reduce-gear-dim", "pad:neutral",
                                                                     "inplace:fresh-tensor")),
}
BLOCKS.update(PAD_BLOCKS)

# Output shapes: the return statement, the blocks it needs, the features it shows.
OUTPUTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "plain": ("return h", (), ()),
    "tuple": ("return h, h.sum(-1)", (), ("output:tuple",)),
    "nested": ("return {'h': h, 'parts': (h.amax(-1), [h[:, :4], None]), 'k': 3}", (),
               ("output:nested", "output:none", "output:scalar", "output:view")),
    "views": ("return h.t(), x[:, :4]", (), ("output:view", "output:alias-input")),
    "dtypes": ("return h.to(torch.bfloat16), h.double().sum(-1)", (), ("dtype:bfloat16", "dtype:float64")),
    "ids_out": ("return h, ids * 3 + 1", ("ids_input",), ("dtype:int64", "output:tuple")),
    "buffer_out": ("return h, self.seen", ("buf_rows",), ("output:buffer",)),
    "gear_sum": ("return h.sum(0)", (), ("op:reduce-gear-dim",)),
    "shape_int": ("return h, h.shape[0]", (), ("output:scalar-from-shape",)),
}

INPUT_ORDER = ("x", "y", "ids", "state", "cache", "mask", "alpha", "n")
GEARED_INPUTS = ("x", "y", "ids", "state", "mask")      # per-call inputs with the batch B as dim 0


def blocks_of(program: dict) -> list[Block]:
    return [BLOCKS[name] for name in program["blocks"]]


def inputs_of(program: dict) -> list[str]:
    """The method's arguments in order: ``x``, then each extra input a block or the output needs."""
    needed = {"x"} | {i for b in blocks_of(program) for i in b.inputs}
    return [name for name in INPUT_ORDER if name in needed]


def attrs_of(program: dict) -> dict[str, tuple]:
    """Constructor arguments and their pools (first value = default)."""
    out: dict[str, tuple] = {}
    for b in blocks_of(program):
        out.update(b.attrs)
    return out


def consts_of(program: dict) -> dict[str, tuple]:
    """Module-level constants and their pools: ``"SCALE"`` in the program file, ``"helper.ALPHA"`` in the helper
    file."""
    out: dict[str, tuple] = {}
    for b in blocks_of(program):
        out.update(b.consts)
        out.update({f"helper.{k}": v for k, v in b.helper_consts.items()})
        out.update({f"closure.{k}": v for k, v in b.closure.items()})
    return out


def tags_of(program: dict) -> set[str]:
    tags = {f"block:{name}" for name in program["blocks"]} | {f"output:{program['output']}"}
    for b in blocks_of(program):
        tags.update(b.tags)
    tags.update(OUTPUTS[program["output"]][2])
    return tags


def default_consts(program: dict) -> dict:
    return {name: pool[0] for name, pool in consts_of(program).items()}


def render(program: dict, consts: dict | None = None) -> dict[str, str]:
    """``{file name: source}`` of the program (and its helper file) with the constants' values ``consts`` (default:
    the first of each pool)."""
    values = {**default_consts(program), **(consts or {})}
    helper_values = {k[len("helper."):]: v for k, v in values.items() if k.startswith("helper.")}
    closure = {k[len("closure."):]: v for k, v in values.items() if k.startswith("closure.")}
    own = {k: v for k, v in values.items() if not k.startswith(("helper.", "closure."))}
    blocks = blocks_of(program)
    attrs = attrs_of(program)
    lines = [f'"""difftest program {program["module"]} (generated: tests/difftest/programs.py)."""',
             "import torch", "import torch.nn.functional as F", ""]
    if helper_values:
        lines.insert(3, f"import {program['helper']} as helper")
        imported = sorted(k for b in blocks for k in b.helper_consts if f"helper.{k}" in values and k != "ALPHA")
        if imported:
            lines.insert(4, f"from {program['helper']} import {', '.join(imported)}")
    lines += [f"{name} = {value!r}" for name, value in own.items()]
    params = "".join(f", {name}={pool[0]!r}" for name, pool in attrs.items())
    lines += ["", "", "class Prog(torch.nn.Module):", f"    def __init__(self{params}):", "        super().__init__()",
              "        self.lin = torch.nn.Linear(16, 16)"]
    lines += [f"        {line}" for b in blocks for line in b.init]
    lines += ["", f"    def fwd(self, {', '.join(inputs_of(program))}):", "        h = self.lin(x)"]
    lines += [f"        {line}" for b in blocks for line in b.body]
    lines += [f"        {OUTPUTS[program['output']][0]}"]
    for b in blocks:
        lines += [""] + [f"    {line}" for line in b.methods]
    lines.append("")
    if closure:
        lines = _in_factory(lines, closure)
    files = {f"{program['module']}.py": "\n".join(lines)}
    if helper_values:
        helper = [f'"""difftest helper of {program["module"]} (generated)."""', "import torch", ""]
        helper += [f"{name} = {value!r}" for name, value in helper_values.items()]
        if "ALPHA" in helper_values:
            helper += ["", "", "def mix(h):", "    return h + ALPHA * torch.tanh(h)"]
        helper.append("")
        files[f"{program['helper']}.py"] = "\n".join(helper)
    return files


def _in_factory(lines: list[str], closure: dict) -> list[str]:
    """The module source with ``class Prog`` built in a factory over the ``closure`` variables (so ``fwd`` reads them
    from its closure); ``set_<name>``/``get_<name>`` rebind and read them."""
    start = lines.index("class Prog(torch.nn.Module):")
    names = ", ".join(closure)
    body = [f"def _make({names}):"] + [f"    {line}" if line else "" for line in lines[start:]]
    for name in closure:
        body += [f"    def set_{name}(value):", f"        nonlocal {name}", f"        {name} = value", "",
                 f"    def get_{name}():", f"        return {name}", ""]
    accessors = "".join(f", set_{n}, get_{n}" for n in closure)
    body += [f"    return Prog{accessors}", "", "",
             f"Prog{accessors} = _make({', '.join(repr(v) for v in closure.values())})", ""]
    return lines[:start] + body
