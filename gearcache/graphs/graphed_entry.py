"""One gear's CUDA graph (:class:`GraphedEntry`): its static input buffers, what a call copies into them and back out,
and what the gear's entry writes in place (gearcache/graphs/cuda_graphs.py captures and replays it).

Inputs updated in place (a KV cache) are best marked with :func:`mark_static_address`: the graph then reads and
writes the caller's tensor itself, and a call passing another tensor is an error. An unmarked input that the graph
writes to (its run plan's ``mutated_inputs``; a padded one included) is written in its static buffer, and copied back
into the caller's tensor after each replay (its real rows, for a padded one), as ``mode="default"`` copies a padded
input's rows back after a run (``GearPlan.copy_back``). An entry without a run plan does not say what it writes: a
write into a copied input found at its capture is refused.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..keys import guard_watch
from ..call import memory, signature, state_alias
from ..call.entry import Entry, mutated_inputs
from ..errors import ConfigError, UnsupportedInputError

if TYPE_CHECKING:
    from .callbacks import UncapturedPath
    from ..compiling.entry_life import Loaded
    from ..gears.plan import GearPlan


STATIC_ADDRESS_ATTR = "_gearcache_static_address"


def mark_static_address(tensor: torch.Tensor) -> torch.Tensor:
    """Declare that ``tensor`` is passed (the same storage) on every call, e.g. a KV cache updated in place."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"mark_static_address: tensor={type(tensor).__qualname__} is not a torch.Tensor")
    setattr(tensor, STATIC_ADDRESS_ATTR, True)
    return tensor


def is_static_address(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and getattr(leaf, STATIC_ADDRESS_ATTR, False)


class GraphedEntry:
    """One entry (one gear) captured as a CUDA graph, with its static input buffers."""

    def __init__(self, entry: Loaded, graph: torch.cuda.CUDAGraph, outs: list[Any],
                 copies: list[tuple[int, torch.Tensor, float]], static_ptrs: list[tuple[int, int]]):
        self.entry, self.graph, self.outs = entry, graph, outs
        self.copies = copies                  # [(leaf index, static buffer, pad value)]
        self.static_ptrs = static_ptrs        # [(leaf index, data_ptr)] of static-address inputs
        self.written: list[tuple[int, torch.Tensor]] = []   # [(leaf index, static buffer)] the graph writes
        # output index -> the copied input's leaf index it is a view of (rebuilt over the caller's tensor), or None:
        # a view of memory outside the graph's pool (a parameter, a buffer, a static-address input), kept as it is
        self.aliases: dict[int, int | None] = {}
        # valid() while every parameter and buffer the graph reads is the same tensor as at its capture
        # (``state_watch_of``)
        self.state_watch: guard_watch.Watch | None = None
        self.retired = False        # dropped from its method's graphs (reset, its entry dropped, captured again)
        self.shortcuts: dict[Any, tuple[Any, GraphShortcut] | None] = {}   # call key -> CudaGraphs.shortcut

    def retire(self) -> None:
        """Take the graph out of service for good: no shortcut or call replays it again (``graph_matcher``), and its
        CUDA graph is destroyed now rather than when the last reference goes (a shortcut, the method's last replayed
        graph, a caller's frame). A destroyed graph that captured NCCL collectives no longer holds its communicator:
        NCCL's teardown (``destroy_process_group``) waits until every such graph is gone. An in-flight replay
        completes (CUDA frees an executing graph when it ends); the static outputs stay valid while referenced."""
        self.retired = True
        self.shortcuts.clear()
        if self.graph is not None:      # (a gear still being recorded has none yet)
            self.graph.reset()

    def state_replaced(self) -> bool:
        """Whether a parameter or buffer the graph reads was replaced by another tensor since its capture (a new KV
        cache bound to the module, ``module.weight = Parameter(...)``): its replays would read and write the old
        one's memory, so the graph must be captured again."""
        return self.state_watch is not None and not self.state_watch.valid()

    def recorded(self, graph: torch.cuda.CUDAGraph, outs: list[Any], static_leaves: tuple[Any, ...]) -> None:
        """Keep the graph recorded on ``static_leaves`` and its static outputs; find which outputs view memory outside
        the graph's pool (``aliases``): eager returns such an output as a view of the caller's argument or of the
        module's tensor, through which later writes show, so it is never copied (``graph_outputs``) nor left a view of
        a static buffer. Raises nothing: a graph dropped once recorded would leave its pool unusable (torch asserts
        at the next capture into it); a call whose view cannot be rebuilt is refused by ``fill``."""
        self.graph, self.outs = graph, outs
        state = state_tensors(self.entry)
        self.aliases = output_aliases(outs, self.copies, static_leaves, state)

    def fill(self, leaves: tuple[Any, ...]) -> None:
        """Copy (and pad) the call's inputs into the static buffers; check the static-address inputs, and the
        inputs an output is a view of (``aliases``: rebuilt over the caller's tensor, which must be laid out as its
        static buffer, contiguous and not padded, and of the view's dtype), before the caller's memory is touched."""
        fill_buffers(self, leaves)
        for k, i in self.aliases.items():
            if i is not None and not (leaves[i].is_contiguous() and leaves[i].shape == self.static_buffer(i).shape
                                      and leaves[i].dtype == self.outs[k].dtype):
                raise UnsupportedInputError(
                    f"under CUDA graphs the method's output {k} is a view of its input {i}, which this call passes "
                    f"non-contiguous or padded (or the view has another dtype): eager returns a view of the caller's "
                    f"tensor, which the view of the graph's copy of the input cannot be rebuilt as. Fix: pass input "
                    f"{i} contiguous (.contiguous()) and unpadded, or return a .clone() of the view")
        for i, ptr in self.static_ptrs:
            if leaves[i].data_ptr() != ptr:
                raise UnsupportedInputError(
                    f"input {i} was marked with mark_static_address, but this call passes another tensor (storage "
                    f"{leaves[i].data_ptr():#x}, captured {ptr:#x}). Pass the same tensor on every call, or call "
                    f".graphs.reset() on the cached method after replacing it")

    def replay(self) -> list[Any]:
        """Run the graph on what ``fill`` left in the buffers; returns its static outputs."""
        self.graph.replay()
        return self.outs

    def static_buffer(self, i: int) -> torch.Tensor:
        """The static buffer of the copied input ``i``."""
        return next(buf for j, buf, _ in self.copies if j == i)

    def over_callers(self, outs: list[Any], leaves: tuple[Any, ...]) -> list[Any]:
        """``outs`` with each view of a copied input's static buffer rebuilt as the same view of the caller's tensor
        (after ``copy_back``: it holds what the replay wrote)."""
        outs = list(outs)
        for k, i in self.aliases.items():
            if i is not None:
                o, leaf = outs[k], leaves[i]
                offset = leaf.storage_offset() + o.storage_offset() - self.static_buffer(i).storage_offset()
                outs[k] = leaf.as_strided(o.shape, o.stride(), offset)
        return outs

    def refuse_overlapping_written(self, leaves: tuple[Any, ...]) -> None:
        """UnsupportedInputError for a call passing, where the graph writes a copied input, a tensor whose own
        elements overlap (``as_strided`` windows: ``memory.elements_may_overlap``): eager's in-place op writes them one
        after another on CPU and in an undefined order on CUDA, the copy back from the static buffer in its own; no
        order is proved equal. Checked on the full call path (the graph shortcut's matcher holds the strides of the
        call it was made for); a contiguous input costs one ``is_contiguous``."""
        for i, _ in self.written:
            leaf = leaves[i]
            if not leaf.is_contiguous() and memory.elements_may_overlap(leaf.shape, leaf.stride()):
                raise UnsupportedInputError(
                    f"the method writes its input {i} in place, and this call passes a tensor whose elements overlap "
                    f"in memory (sizes {tuple(leaf.shape)}, strides {leaf.stride()}): under CUDA graphs it is written "
                    f"through a copy, in an order eager's in-place writes need not follow. Fix: pass a .clone() of it")

    def copy_back(self, leaves: tuple[Any, ...]) -> None:
        """Copy what the replay wrote into copied inputs back into the caller's tensors (their real rows)."""
        for i, buf in self.written:
            dst = leaves[i]
            dst.copy_(buf if buf.shape == dst.shape else buf[tuple(slice(0, n) for n in dst.shape)])


def output_aliases(outs: list[Any], copies: list[tuple[int, torch.Tensor, float]], static_leaves: tuple[Any, ...],
                   state: list[torch.Tensor]) -> dict[int, int | None]:
    """``GraphedEntry.aliases`` of a graph's static ``outs``: by storage, the copied input each output views (its
    leaf index), or None for a view of a module tensor or a static-address input (memory outside the pool)."""
    copied = {memory.storage_address(buf): i for i, buf, _ in copies}
    outside = {memory.storage_address(t) for t in state}
    outside |= {memory.storage_address(x) for x in static_leaves if is_static_address(x)}
    found: dict[int, int | None] = {}
    for k, o in enumerate(outs):
        if isinstance(o, torch.Tensor):
            address = memory.storage_address(o)
            if address in copied:
                found[k] = copied[address]
            elif address in outside:
                found[k] = None
    return found


def state_tensors(entry: Loaded) -> list[torch.Tensor]:
    """The parameters and buffers ``entry``'s graph reads (none for an eager stand-in)."""
    return [d[name] for d, name in entry.state_refs()] if isinstance(entry, Entry) else []


def fill_buffers(graphed: GraphedEntry, leaves: tuple[Any, ...]) -> None:
    """Copy (and pad) the call's inputs into the static buffers without replaying."""
    for i, buf, pad in graphed.copies:
        src = leaves[i]
        if src.shape == buf.shape:
            buf.copy_(src)
        else:
            buf.fill_(pad)
            buf[tuple(slice(0, s) for s in src.shape)].copy_(src)


def target_shape(gear_plan: GearPlan, leaves: tuple[Any, ...], targets: list[int], i: int) -> list[int]:
    shape = list(leaves[i].shape)
    for d, t in zip(gear_plan.dims, targets):
        if d.leaf == i:
            shape[d.dim] = t
    return shape


def mutated_leaves(entry: Loaded) -> list[int] | None:
    """Call leaves that the entry's graph writes in place, from its run plan (``mutated_inputs``); None when the
    entry was loaded without a plan (then only a run can tell)."""
    mutated = _plan_mutated(entry)
    if mutated is None:
        return None
    inputs = entry.manifest["inputs"]
    return [int(inputs[j][1]) for j in mutated if inputs[j][0] == "leaf"]


def _plan_mutated(entry: Loaded) -> list[int] | None:
    """The graph inputs the entry writes in place, as its run plan says (an unsupported plan too, where its writer
    could read them: ``runplan.loader.TorchLoaded``); None when unknown."""
    return mutated_inputs(entry.compiled)


def written_tensors(entry: Loaded, static_leaves: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors a run of ``entry`` on ``static_leaves`` may write in place: its run plan's ``mutated_inputs``
    (call leaves and module state alike: a KV cache, a position counter); without a run plan, every static-address leaf
    and every buffer it reads (a run alone could tell; these are what a method may legitimately update). For an
    eager stand-in (``faults.EagerEntry``), which runs the method as written: every tensor leaf."""
    if not isinstance(entry, Entry):
        return [x for x in static_leaves if isinstance(x, torch.Tensor)]
    inputs = entry.gather(static_leaves)
    mutated = _plan_mutated(entry)
    if mutated is not None:
        return [inputs[j] for j in mutated if isinstance(inputs[j], torch.Tensor)]
    kinds = entry.manifest["inputs"]
    return [x for (kind, ref), x in zip(kinds, inputs) if isinstance(x, torch.Tensor) and (
        (kind == "leaf" and is_static_address(x)) or (kind == "state" and not isinstance(x, torch.nn.Parameter)))]


def refuse_split_memory(cached: UncapturedPath, geared: bool, leaves: tuple[Any, ...], key: tuple[Any, ...]) -> None:
    """``UnsupportedInputError`` for a CUDA call whose inputs share memory (``signature.shares_storage``; with a gear
    plan ``shares_memory``, the same tensor twice too) that the static buffers' copies would split: a copied input
    overlapping another's memory (``memory.copies_split``; static-address inputs are not copied). Inputs over apart
    parts of one storage (``kv[0]``, ``kv[1]``) are copied, written and copied back apart, as eager writes them."""
    shared = signature.shares_memory(key) if geared else signature.shares_storage(key)
    if shared and signature.on_cuda(leaves) and memory.copies_split(
            leaves, tuple(x if is_static_address(x) else None for x in leaves), shared):
        raise UnsupportedInputError(signature.shared_memory_message(
            cached.name, key, "a CUDA graph copies each input into a static buffer of its own", cached.gear_life.method,
            leaves))


def refuse_state_aliases(cached: UncapturedPath, entry: Loaded, leaves: tuple[Any, ...],
                         key: tuple[Any, ...]) -> None:
    """``UnsupportedInputError`` for a call (``leaves``, keyed ``key``) of ``cached`` with an argument sharing memory
    with a module tensor ``entry`` reads or writes (gearcache/call/state_alias.py); nothing for any other call. A
    graph reads and writes the module tensors in place, and its copies of the inputs are filled before the replay and
    copied back after it: the compiled order shows as with the entry."""
    if isinstance(entry, Entry) and entry.state_aliases:
        state_alias.refuse(cached.name, cached.gear_life.method, entry.state_aliases, leaves, key)


def state_rules_of(entry: Loaded) -> state_alias.Rules:
    """``entry``'s ``state_aliases`` (none for an eager stand-in): what a graph shortcut's matcher also checks."""
    return entry.state_aliases if isinstance(entry, Entry) else state_alias.NO_RULES


def state_watch_of(entry: Loaded) -> guard_watch.Watch | None:
    """A watch over the ``_parameters`` / ``_buffers`` items the entry's graph reads (``GraphedEntry.state_watch``):
    the graph holds their addresses, so replacing one of them must lead to a new capture. None when it reads none."""
    if not isinstance(entry, Entry):
        return None
    items = [(d, name, d[name]) for d, name in entry.state_refs()]
    return guard_watch.GuardWatch(items, [], [], guard_watch.ABSENT) if items else None


def written_copies(entry: Loaded, copies: list[tuple[int, torch.Tensor, float]]) -> list[tuple[int, torch.Tensor]]:
    """``(leaf index, static buffer)`` of each copied (not static-address) input the entry's run plan says it writes:
    copied back after each replay (``GraphedEntry.copy_back``). Without a run plan: none (a write found at the
    capture's warm-up run is refused there)."""
    mutated = set(mutated_leaves(entry) or ())
    return [(i, buf) for i, buf, _ in copies if i in mutated]


def write_refused_message(i: int) -> str:
    return (f"the method writes to its input {i} in place, and its entry has no run plan saying so; under CUDA graphs "
            f"such an input must keep its storage. Fix: gearcache.mark_static_address(tensor) on it (and pass the "
            f"same tensor on every call)")


class GraphShortcut:
    """What the dispatcher's shortcut (gearcache/call/dispatch.py) serves a call like the last one with, for a method
    without a gear plan under CUDA graphs: ``run(leaves)`` is the whole replay of ``graphed`` (``replay(graphed,
    leaves)``: fill, replay, copy back, the outputs as the method returns them) and ``build`` hands its result on.
    Its matcher (:func:`graph_matcher`) answers False once the graph may not serve the call as the full path would."""
    __slots__ = ("run", "hits")
    result_outputs = None

    def __init__(self, run: Callable[[tuple[Any, ...]], Any]):
        self.run = run
        self.hits = 0

    @staticmethod
    def build(result: Any, leaves: tuple[Any, ...]) -> Any:
        return result


def graph_matcher(matches: Callable[..., bool], graphed: GraphedEntry) -> Callable[..., bool]:
    """``matches`` (the call's signature: ``signature.Matcher.check``), and ``graphed`` still what the full path
    (``CudaGraphs.call``) would replay for it: not retired, its parameters and buffers not replaced, each
    static-address input the very tensor of its capture and each copied input not marked static (the graph key's
    ``is_static_address``)."""
    statics = tuple(graphed.static_ptrs)
    copied = tuple(i for i, _, _ in graphed.copies)
    watch = graphed.state_watch

    def check(*args: Any) -> bool:
        if graphed.retired or (watch is not None and not watch.valid()):
            return False
        for i, ptr in statics:
            if not getattr(args[i], STATIC_ADDRESS_ATTR, False) or args[i].data_ptr() != ptr:
                return False
        for i in copied:
            if getattr(args[i], STATIC_ADDRESS_ATTR, False):
                return False
        return matches(*args)
    return check
