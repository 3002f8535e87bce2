"""Draw a run: a few programs, then cases over them, seeded, within a compile budget.

Compiling is what costs (a few seconds per entry on a 2-core CPU), so values, shapes and options come from small
pools and every case of a run shares one store: most cases load entries that earlier cases compiled. That sharing is
the test: a case whose signature matches an entry compiled for *other* attribute or constant values must still equal
eager (miss and compile, or be refused), never load the other values' graph.

The :class:`Ledger` keeps the budget. An entry is identified by what a sound key must separate: the program, the
values the method reads (attributes, module constants), the route, the decompositions and the call's padded
signature. A drawn case that would add more identities than the budget has left is drawn again (30 tries), then
falls back to an earlier case's entry choices with fresh free options (weights, inputs, gear declaration, policies).
The count is an upper bound of what a correct gearcache compiles; today's gearcache compiles fewer (its stale hits).

Each case is run twice: in the compiling process (``side="main"``, its ``assign`` constants set in-process), and
later in a fresh process (``side="warm"``) whose program files hold the constants of the case's ``warm_batch``:
batch 0 the defaults, batch 1 every constant at its other value (a file edited between compile and load).
"""
from __future__ import annotations

import json
import random

from . import programs as P

ATTR_BLOCKS = ("layernorm", "gelu", "heads", "act", "residual", "scale", "roll", "global_scale", "helper_fn",
               "helper_const", "closure_scale")
CHANGE_SHARE = 0.2          # cases that change the model (runner.CHANGES) before the first call or after it
VALUE_NEUTRAL_CHANGES = ("submodule",)      # a change of weights only: the entry stays the same
# an output every geared case refuses (a size gears pad, returned as a number) is not given to a program whose blocks
# bring an optional input: that program would almost never show a None or a tensor for it equal to eager
REFUSED_WITH_GEARS = ("shape_int",)
OPTIONAL_INPUT_BLOCKS = ("mask_opt",)
GEAR_SIZES = ([2, 4], [2, 4], [2, 4], [4])
NEW_SIGNATURE_SHARE = 0.6
# cases drawn on the torch.compile route whatever the dice say (a CPU run): the budget for new signatures is spent
# within the first ~20 cases, and a route is part of an entry's signature, so later draws of it rarely fit
TORCH_COMPILE_CASES = (2, 13)


# Programs of the pad-value-sensitive blocks (programs.PAD_BLOCKS), added after the ``n`` drawn ones so that those
# stay as they were: two groups one pad value serves (x: -inf, ids: int64's largest; x: 0, ids: its smallest), and one
# none serves (a min needs +inf, a mean nothing; tests/test_difftest.py serves a min alone).
PAD_PROGRAMS = (("pad_amax", "pad_neg_min", "pad_argmax", "pad_softmax", "pad_logsumexp", "ids_min"),
                ("pad_sum", "pad_prod", "fresh_rows", "ids_max"), ("pad_amin", "pad_mean"))


def draw_programs(rng: random.Random, n: int) -> list[dict]:
    """``n`` programs; every block and every output appears in at least one when ``n`` is large enough (blocks are
    dealt round-robin: first one that reads an attribute or constant to each program, then the others); then one
    program per group of :data:`PAD_PROGRAMS`."""
    attr_blocks = list(ATTR_BLOCKS)
    rest = [b for b in P.BLOCKS if b not in ATTR_BLOCKS and b not in P.PAD_BLOCKS]
    rng.shuffle(attr_blocks)
    rng.shuffle(rest)
    dealt: list[list[str]] = [[] for _ in range(n)]
    for i, block in enumerate(attr_blocks + rest):
        dealt[i % n].append(block)
    for blocks in dealt:
        if len(blocks) < 3:
            blocks += rng.sample([b for b in P.BLOCKS if b not in blocks and b not in ATTR_BLOCKS
                                  and b not in P.PAD_BLOCKS], 3 - len(blocks))
    outputs = list(P.OUTPUTS)
    rng.shuffle(outputs)
    outputs.sort(key=lambda o: not P.OUTPUTS[o][1])         # outputs that need a block are placed first
    chosen: dict[int, str] = {}
    for output in outputs:
        usable = [k for k in range(n) if k not in chosen and all(r in dealt[k] for r in P.OUTPUTS[output][1])
                  and not (output in REFUSED_WITH_GEARS and set(dealt[k]) & set(OPTIONAL_INPUT_BLOCKS))]
        if usable:
            chosen[usable[0]] = output
    for k in range(n):
        chosen.setdefault(k, rng.choice([o for o in P.OUTPUTS if not P.OUTPUTS[o][1]]))
    drawn = [{"module": f"dtp_{k}", "helper": f"dth_{k}", "blocks": _ordered(dealt[k]), "output": chosen[k],
              "gear_sizes": list(rng.choice(GEAR_SIZES))} for k in range(n)]
    return drawn + [{"module": f"dtp_{n + k}", "helper": f"dth_{n + k}", "blocks": _ordered(list(group)),
                     "output": "tuple", "gear_sizes": [2, 4]} for k, group in enumerate(PAD_PROGRAMS)]


def _ordered(blocks: list[str]) -> list[str]:
    """In-place writes of inputs first (they read ``x``), the rest in grammar order: stable and readable."""
    order = list(P.BLOCKS)
    return sorted(blocks, key=order.index)


def value_variants(rng: random.Random, program: dict) -> list[dict]:
    """2-3 sets of values the method reads: ``{"attrs": {...}, "consts": {...}}``. Variant 0: every default;
    variant 1: every other value; variant 2 (with two or more): a mixture."""
    pools = {**{("attr", k): v for k, v in P.attrs_of(program).items()},
             **{("const", k): v for k, v in P.consts_of(program).items()}}
    if not pools:
        return [{"attrs": {}, "consts": {}}]
    picks = [{k: v[0] for k, v in pools.items()}, {k: v[1] for k, v in pools.items()}]
    if len(pools) >= 2:
        picks.append({k: rng.choice(v) for k, v in pools.items()})
    out = []
    for pick in picks:
        variant = {"attrs": {k: _json(v) for (kind, k), v in pick.items() if kind == "attr"},
                   "consts": {k: v for (kind, k), v in pick.items() if kind == "const"}}
        if variant not in out:
            out.append(variant)
    return out


def _json(value):
    return list(value) if isinstance(value, tuple) else value


class Ledger:
    """Entry identities (see the module docstring) and gear plans the run may create; ``fits`` / ``add``."""

    def __init__(self, max_compiles: int, max_plans: int):
        self.max_compiles, self.max_plans = max_compiles, max_plans
        self.identities: set[str] = set()
        self.plans: set[str] = set()
        self.signatures: dict[str, set[str]] = {}           # entry signature -> value sets seen with it

    def cost(self, case: dict) -> tuple[set[str], set[str]]:
        ids, plans = set(), set()
        unchanged = dict(case, change=None)                 # a change after the first call: the entries before it
        for values in (main_values(case), warm_values(case), main_values(unchanged), warm_values(unchanged)):
            for sig in signatures(case):
                ids.add(json.dumps([values, sig], sort_keys=True))
        gears = case["options"].get("gears")
        if gears and case["options"]["route"] == "cache_compile":
            plans.add(json.dumps([case["program"]["module"], gears["policy"], gears["sizes"], gears["pad"],
                                  case.get("mask")], sort_keys=True))
        return ids - self.identities, plans - self.plans

    def fits(self, case: dict) -> bool:
        """Whether the case's new identities fit the budget. An identity of a signature no other values have yet may
        only take the first ``NEW_SIGNATURE_SHARE`` of it: the rest is kept for other values on known signatures
        (the situation a stale key gets wrong)."""
        ids, plans = self.cost(case)
        known = {json.dumps(json.loads(i)[1], sort_keys=True) for i in self.identities}
        new_sigs = [i for i in ids if json.dumps(json.loads(i)[1], sort_keys=True) not in known]
        limit = self.max_compiles if not new_sigs else int(self.max_compiles * NEW_SIGNATURE_SHARE)
        return (len(self.identities) + len(ids) <= limit and
                len(self.plans) + len(plans) <= self.max_plans)

    def add(self, case: dict) -> None:
        ids, plans = self.cost(case)
        shared = False
        for values in (main_values(case), warm_values(case)):
            for sig in signatures(case):
                key = json.dumps(sig, sort_keys=True)
                seen = self.signatures.setdefault(key, set())
                value_key = json.dumps(values, sort_keys=True)
                shared |= bool(seen - {value_key})
                seen.add(value_key)
        if shared:
            case["tags"].append("values:entry-shared-with-other-values")
        self.identities |= ids
        self.plans |= plans


def main_values(case: dict) -> list:
    return _changed(case, [case["program"]["module"], case.get("attrs", {}),
                           {**P.default_consts(case["program"]), **case.get("assign", {})}])


def warm_values(case: dict) -> list:
    return _changed(case, [case["program"]["module"], case.get("attrs", {}),
                           warm_consts(case["program"], case["warm_batch"])])


def _changed(case: dict, values: list) -> list:
    """``values`` as the case's change leaves them (its last entries are used after it): a closure rebound holds the
    rebound value; any other change of what entries bake in is named."""
    from .runner import CLOSURE_REBOUND

    change = case.get("change")
    if not change or change["kind"] in VALUE_NEUTRAL_CHANGES:
        return values
    if change["kind"] == "closure_rebind":
        return values[:2] + [{**values[2], "closure.CSCALE": CLOSURE_REBOUND}]
    return values + [change["kind"]]


def warm_consts(program: dict, batch: int) -> dict:
    """The constants the program file holds in warm batch ``batch`` (0: defaults, 1: every other value)."""
    return {k: pool[1 if batch else 0] for k, pool in P.consts_of(program).items()}


def signatures(case: dict) -> list:
    """The padded signature of each entry the case reaches (route, decompositions, sizes, strides, scalars), in the
    order its calls reach them; stops where a call is refused for sure (past the largest gear with "error")."""
    o = case["options"]
    gears = o.get("gears")
    head = [case["program"]["module"], o["route"], o.get("decompositions"), case.get("mask")]
    sigs = []
    calls = list(case["calls"])
    if o.get("warmup") and gears:
        calls = [dict(calls[0], B=s, noncontig=[]) for s in gears["sizes"]] + calls
    for call in calls:
        target, padded = call["B"], False
        if gears:
            fitting = [s for s in gears["sizes"] if s >= call["B"]]
            if fitting:
                target, padded = fitting[0], fitting[0] != call["B"]
            elif o["past_largest"] == "error":
                break
            elif o["past_largest"] == "eager":
                continue
        sig = head + [target, [] if padded else sorted(call.get("noncontig", [])), call.get("alpha"), call.get("n")]
        if sig not in sigs:
            sigs.append(sig)
        if not o.get("dynamic", True) and len(sigs) > 1:
            sigs.pop()
            break
    return sigs


def draw_case(rng: random.Random, index: int, seed: int, program: dict, variants: list[dict], device: str,
              graphs: bool, wanted: set[str] | None = None, mask: bool | None = None) -> dict:
    """One case of ``program`` (its value variant, options and calls); ``tags`` name the features it exercises.
    ``wanted``: change kinds no case drew yet; ``mask``: the optional input's state no case of the program drew yet
    (None: drawn)."""
    variant_index = rng.choices(range(len(variants)), weights=[2] + [1] * (len(variants) - 1))[0]
    variant = variants[variant_index]
    inputs = P.inputs_of(program)
    tags = sorted(P.tags_of(program)) + [f"values:variant-{variant_index}"]
    options = _draw_options(rng, program, device, graphs, force_torch_compile=index in TORCH_COMPILE_CASES)
    case = {"id": index, "seed": seed, "device": device,
            "program": dict(program, inputs=inputs),
            "attrs": variant["attrs"], "assign": _assign(program, variant["consts"]),
            "warm_batch": 1 if P.consts_of(program) and rng.random() < 0.4 else 0,
            "options": options, "mask": "mask" in inputs and _choose_mask(rng.random() < 0.5, mask),
            "calls": _draw_calls(rng, inputs, options, program["gear_sizes"]), "tags": tags}
    _hide_pads(rng, case)
    _draw_change(rng, case, wanted or set())
    _tag_case(case)
    return case


def _hide_pads(rng: random.Random, case: dict) -> None:
    """A program with a reduction over the geared dim of its inputs (programs.PAD_BLOCKS): its first call's data is
    mixed (which hides a wrong pad from a min or a max), its later ones all positive or all negative (which show
    it)."""
    if not any(b in P.PAD_BLOCKS for b in case["program"]["blocks"]):
        return
    for k, call in enumerate(case["calls"]):
        call["data"] = "mixed" if k == 0 else rng.choice(["positive", "negative"])
    if len(case["calls"]) > 1 and case["options"].get("gears"):
        case["tags"].append("data:pad-shown-after-first-call")


def _draw_change(rng: random.Random, case: dict, wanted: set[str]) -> None:
    """A change of the model (``runner.CHANGES``) for a share of the cases on the cache_compile route: one the program
    can take (one of ``wanted``, kinds no earlier case drew, where it can), before its first call or after it (then
    the case has a second call to see it). A case that takes a wanted kind is made cheap: its calls share one
    signature."""
    from .runner import CHANGES

    if case["options"]["route"] != "cache_compile":
        return
    kinds = [k for k, (needs, _) in CHANGES.items() if not needs or set(needs) & set(case["program"]["blocks"])]
    fresh = [k for k in kinds if k in wanted]
    if not fresh and rng.random() >= CHANGE_SHARE:
        return
    change = {"kind": rng.choice(fresh or kinds), "when": rng.choice(["before", "after"])}
    if fresh:       # the first of its kind: one signature, no gears (a padding refusal would hide the change)
        case["calls"] = [dict(case["calls"][0])]
        case["options"].update(dynamic=True, gears=None, past_largest="compile")
    case["change"] = change
    case["options"]["warmup"] = case["options"]["verify_padding"] = False
    if change["when"] == "after" and len(case["calls"]) < 2:
        case["calls"].append(dict(case["calls"][0]))


def _assign(program: dict, consts: dict) -> dict:
    defaults = P.default_consts(program)
    return {k: v for k, v in consts.items() if defaults[k] != v}


def _draw_options(rng: random.Random, program: dict, device: str, graphs: bool,
                  force_torch_compile: bool = False) -> dict:
    route = "torch_compile" if (rng.random() < 0.05 or force_torch_compile) and not graphs else "cache_compile"
    gears = None
    if rng.random() < 0.65:
        gears = {"sizes": program["gear_sizes"], "declare": rng.choice(["marks", "by_name"]),
                 "policy": rng.choice(["zip", "product"]), "pad": _pad_choice(rng.random())}
        if route == "torch_compile":
            gears["declare"] = "marks"
    options = {"route": route, "gears": gears, "past_largest": rng.choice(["error", "eager", "compile"]),
               "dynamic": rng.random() >= 0.08, "decompositions": "addmm" if rng.random() < 0.08 else None,
               "warmup": bool(gears) and rng.random() < 0.08, "verify_padding": False, "mode": "default"}
    if options["warmup"]:
        options["verify_padding"] = rng.random() < 0.4
    if route == "torch_compile":
        options.update(dynamic=True, decompositions=None, warmup=False, verify_padding=False)
    if device == "cuda" and graphs:
        options.update(mode="reduce-overhead", graph_outputs=rng.choice(["copy", "view", "view-checked"]),
                       capture_graphs=rng.choice(["warmup", "first_call"]), static_address=rng.random() < 0.75)
        if options["capture_graphs"] == "warmup" and gears:
            options["warmup"] = rng.random() < 0.7
    if device == "cuda":                # the model and its float inputs in bfloat16 or float32 (the CPU: float32)
        options["dtype"] = rng.choice(["float32", "bfloat16"])
    return options


def _pad_choice(r: float) -> float | None:
    """The gears' pad value: 1 (15 %), 0 given explicitly (20 %), or none given (gearcache chooses one)."""
    return 1.0 if r < 0.15 else 0.0 if r < 0.35 else None


def _draw_calls(rng: random.Random, inputs: list[str], options: dict, sizes: list[int]) -> list[dict]:
    """1-3 calls. Sizes: 1 to the largest gear with gears (or past it), else mostly the gear sizes (the entries the
    program's geared cases reach too)."""
    gears = options["gears"]
    calls = []
    for _ in range(rng.choice([1, 2, 2, 3, 3])):
        if gears:
            past = rng.random() < 0.12
            largest = max(gears["sizes"])
            B = rng.choice([largest + 1, largest + 2]) if past else rng.randint(1, largest)
        else:
            B = rng.choice(sizes) if rng.random() < 0.9 else 3
        if options["route"] == "torch_compile":
            B = max(B, 2)                   # Dynamo specialises sizes 0 and 1 (a marked dim of size 1 is not dynamic)
        strided = [n for n in inputs if n in ("x", "y", "state", "ids") and rng.random() < 0.15]
        call = {"B": B, "noncontig": sorted(strided)}
        if "alpha" in inputs:
            call["alpha"] = 0.5 if rng.random() < 0.75 else 2.0
        if "n" in inputs:
            call["n"] = rng.choice([1, 1, 2])
        calls.append(call)
    return calls


def _tag_case(case: dict) -> None:
    o, tags = case["options"], case["tags"]
    tags.append(f"route:{o['route']}")
    gears = o.get("gears")
    if gears:
        tags += [f"gears:{gears['policy']}", f"gears:{gears['declare']}", f"gears:sizes-{gears['sizes']}"]
        if gears["pad"]:
            tags.append("gears:pad-value-nonzero")
        if gears["pad"] is None:
            tags.append("gears:pad-value-chosen")
        if any(c["B"] not in gears["sizes"] and c["B"] < max(gears["sizes"]) for c in case["calls"]):
            tags.append("gears:padded-call")
        if any(c["B"] > max(gears["sizes"]) for c in case["calls"]):
            tags.append(f"past-largest:{o['past_largest']}")
    else:
        tags.append("gears:none")
    for flag, tag in ((not o.get("dynamic", True), "dynamic:false"), (o.get("decompositions"), "decompositions"),
                      (o.get("warmup"), "warmup"), (o.get("verify_padding"), "verify-padding"),
                      (case["assign"], "const:assigned-in-process"), (case["warm_batch"], "const:file-edited"),
                      (any(c.get("noncontig") for c in case["calls"]), "input:non-contiguous"),
                      ("mask" in case["program"]["inputs"], f"input:optional-{'tensor' if case['mask'] else 'None'}"),
                      (len(case["calls"]) > 1, "calls:several")):
        if flag:
            tags.append(tag)
    if o.get("dtype"):
        tags.append(f"model-dtype:{o['dtype']}")
    if case.get("change"):
        tags += [f"change:{case['change']['kind']}", f"change:{case['change']['when']}"]
    if o.get("mode") == "reduce-overhead":
        tags += ["cuda-graphs", f"graph-outputs:{o['graph_outputs']}", f"capture-graphs:{o['capture_graphs']}"]
        if o.get("static_address") and "cache" in case["program"]["inputs"]:
            tags.append("mark-static-address")


def draw_run(seed: int, cases: int, *, device: str = "cpu", graphs: bool = False, n_programs: int = 9,
             max_compiles: int = 48, max_plans: int = 30) -> tuple[list[dict], list[dict], Ledger]:
    """``(programs, cases, ledger)`` of a run: deterministic in its arguments. Case ``i`` has seed
    ``case_seed(seed, i)`` (its weights and inputs) and program ``i % len(programs)`` (``n_programs`` drawn ones and
    the :data:`PAD_PROGRAMS`)."""
    rng = random.Random(seed)
    progs = draw_programs(rng, n_programs)
    variants = {p["module"]: value_variants(rng, p) for p in progs}
    ledger = Ledger(max_compiles, max_plans)
    out: list[dict] = []
    for i in range(cases):
        program = progs[i % len(progs)]
        case_rng = random.Random(f"{seed}/{i}")
        wanted, mask = _changes_wanted(out), _mask_wanted(out, program)
        for _ in range(30):
            case = draw_case(case_rng, i, case_seed(seed, i), program, variants[program["module"]], device, graphs,
                             wanted, mask)
            if ledger.fits(case):
                break
        else:
            case = _reuse(case_rng, i, seed, program, out, device, graphs, ledger)
        ledger.add(case)
        out.append(case)
    return progs, out, ledger


def _choose_mask(drawn: bool, wanted: bool | None) -> bool:
    return drawn if wanted is None else wanted


def _mask_wanted(done: list[dict], program: dict) -> bool | None:
    """The optional input's state (a tensor: True, None: False) no earlier case of ``program`` drew, else None."""
    seen = {bool(c.get("mask")) for c in done if c["program"]["module"] == program["module"]}
    missing = [state for state in (False, True) if state not in seen]
    return missing[0] if missing and seen else None


def _changes_wanted(done: list[dict]) -> set[str]:
    """The change kinds (runner.CHANGES) no case drew yet."""
    from .runner import CHANGES

    return set(CHANGES) - {c["change"]["kind"] for c in done if c.get("change")}


def _reuse(rng: random.Random, index: int, seed: int, program: dict, done: list[dict], device: str, graphs: bool,
           ledger: Ledger) -> dict:
    """Over budget: an earlier case of the program (of any program if none fits) with its entry choices (values,
    gears, sizes, scalars, route) and fresh free ones (seed, declaration, policy, past-largest policy between "error"
    and "eager", order of calls); one whose new choices fit the budget (else one as it was)."""
    earlier = [c for c in done if c["program"]["module"] == program["module"] and ledger.fits(c)]
    if not earlier:     # none of this program fits the budget yet: another program's (its first case would not)
        earlier = [c for c in done if ledger.fits(c)]
    first = rng.choice(earlier)
    for pick in [first] + [c for c in earlier if c is not first]:
        case = _reused(rng, pick, index, seed)
        if ledger.fits(case):
            return case
    return _reused(None, first, index, seed)


def _reused(rng: random.Random | None, pick: dict, index: int, seed: int) -> dict:
    """``pick`` as case ``index``, its free choices drawn again (kept as they were without ``rng``)."""
    base = json.loads(json.dumps(pick))
    base.update(id=index, seed=case_seed(seed, index))
    base["tags"] = [t for t in base["tags"] if not t.startswith(("gears:", "past-largest:", "calls:", "values:entry"))]
    base["tags"].append("reused-entry-choices")
    o = base["options"]
    if o.get("gears") and o["route"] == "cache_compile" and rng is not None:
        o["gears"]["declare"] = rng.choice(["marks", "by_name"])
        if o["past_largest"] != "compile":
            o["past_largest"] = rng.choice(["error", "eager"])
    if rng is not None and not base.get("change"):  # a change comes before or after a given call
        rng.shuffle(base["calls"])
    base["tags"] = sorted(set(base["tags"]) - {f"route:{o['route']}", "dynamic:false", "decompositions", "warmup",
                                               "verify-padding", "input:non-contiguous", "calls:several"})
    base["tags"] = [t for t in base["tags"] if not t.startswith(("route:", "cuda-graphs", "graph-", "capture-"))]
    _tag_case(base)
    base["tags"] = sorted(set(base["tags"]))
    return base


def case_seed(seed: int, index: int) -> int:
    return random.Random(f"case-seed/{seed}/{index}").randrange(2 ** 31)
