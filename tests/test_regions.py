"""Regional compilation (issue #36): each distinct block compiled once per signature, shared by every block.

``compile_blocks`` on a model of three ``Attn`` blocks (a buffer of their own and a caller's tensor written in place)
and two ``Gated`` blocks (tests/scripts/regions_child.py), and ``enable(model, regions="blocks")`` on tiny Llamas
(tests/scripts/run_hf_regions.py): outputs and every tensor written in place equal eager's, in the compiling process
and in fresh warm processes whose counters prove they compiled nothing; compiles = distinct blocks x signatures."""
import copy
import io

import pytest
import torch

from conftest import Script, ahead
from gearcache import compile_blocks
from gearcache.errors import ConfigError
from gearcache.regions import BlockForward, find_blocks


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _Other(_Block):
    pass


def test_find_blocks_takes_repeated_classes_outermost_and_in_model_order():
    inner = torch.nn.Sequential(_Block(), _Block())
    model = torch.nn.Sequential(torch.nn.ModuleList([_Block(), _Other(), _Block(), _Other()]), inner,
                                torch.nn.Linear(4, 4))
    found = find_blocks(model)
    assert [type(b) for b in found] == [_Block, _Other, _Block, _Other, _Block, _Block]
    assert find_blocks(model, [_Other]) == [model[0][1], model[0][3]]
    outer = torch.nn.ModuleList([torch.nn.Sequential(_Block(), _Block()) for _ in range(2)])
    assert find_blocks(torch.nn.Sequential(outer)) == list(outer), "blocks inside a chosen block run in its graph"


def test_compile_blocks_refuses_what_it_cannot_place(tmp_path):
    with pytest.raises(ConfigError, match="no repeated blocks"):
        compile_blocks(torch.nn.Sequential(_Block(), torch.nn.Linear(4, 4)), cache_dir=str(tmp_path))
    hooked = torch.nn.ModuleList([_Block(), _Block(), _Block()])
    hook = hooked[2].register_forward_hook(lambda *a: None)
    with pytest.raises(ConfigError, match=r"block 2 \(_Block\) has forward hooks"):
        compile_blocks(hooked, cache_dir=str(tmp_path))
    assert not any("forward" in b.__dict__ for b in hooked), "a refusal leaves every block as it was"
    hook.remove()
    assert len(compile_blocks(hooked, cache_dir=str(tmp_path)).blocks) == 3, "the fix it names works"
    model = torch.nn.ModuleList([_Block(), _Block()])
    regions = compile_blocks(model, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="already replaced"):
        compile_blocks(model, cache_dir=str(tmp_path))
    regions.remove()
    assert "forward" not in model[0].__dict__


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "llama"}, r"model=str\): expected a torch.nn.Module"),
    ({"blocks": _Block}, r"blocks=<class .*_Block'>: expected a list of block classes. Fix: blocks=\[_Block\]"),
    ({"blocks": "_Block"}, r"blocks='_Block': expected a list of block classes"),
    ({"blocks": [_Block()]}, r"blocks: a _Block instance is not an nn.Module class. Fix: blocks=\[_Block\]"),
    ({"blocks": [torch.nn.Conv2d]}, r"blocks=\[Conv2d\]\): the model holds no module of these classes"),
    ({"cache_dir": 5}, r"cache_dir=5: expected a folder path"),
])
def test_compile_blocks_names_a_bad_argument_its_value_and_the_fix(tmp_path, kwargs, message):
    """A wrong argument is a ConfigError naming it, not an AttributeError or TypeError from inside (a model that is
    not a module, a lone class or an instance for ``blocks``), nor "no repeated blocks" for classes the model lacks."""
    args = {"model": torch.nn.ModuleList([_Block(), _Block()]), "cache_dir": str(tmp_path), **kwargs}
    with pytest.raises(ConfigError, match=message):
        compile_blocks(args.pop("model"), **args)
    regions = compile_blocks(torch.nn.ModuleList([_Block(), _Other()]), cache_dir=str(tmp_path),
                             blocks=(k for k in [_Other]))
    assert [type(b) for b in regions.blocks] == [_Other], "an iterable of classes is read once"


def test_a_call_whose_shapes_do_not_fit_raises_the_ops_error_named_after_the_block(tmp_path):
    """A block called with a [3, 5] input for its [4, 4] weight: the op's RuntimeError, named after the block's
    forward, not Dynamo's report of the fake tensors it traced with."""
    model = torch.nn.ModuleList([_Block(), _Block()]).eval()
    compile_blocks(model, cache_dir=str(tmp_path))
    expected = r"^_Block.forward: .*\[3, 5\].* refused the call's "
    with torch.no_grad(), pytest.raises(RuntimeError, match=expected) as err:
        model[0](torch.randn(3, 5))
    assert type(err.value) is RuntimeError and "FakeTensor" not in str(err.value)


def _half(x):
    return x * 0.5


class _Opaque(_Block):
    def forward(self, x):
        return _half(self.lin(x))


def test_a_python_function_kept_as_one_op_is_a_clear_error(tmp_path):
    """A Python function Dynamo keeps as one op of the graph (``torch.compiler.allow_in_graph``; a torch function
    replaced by one, ``torch.nn.functional.silu = f``, is kept so where Dynamo first looks it up after the patch),
    which no stored artifact can hold: the error names it and the fix (was torch's "CompiledArtifact.save failed
    ... no aot_autograd artifacts")."""
    torch.compiler.allow_in_graph(_half)
    model = torch.nn.ModuleList([_Opaque(), _Opaque()]).eval()
    compile_blocks(model, cache_dir=str(tmp_path))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"calls test_regions._half, a Python function .* Fix: "):
        model[0](torch.randn(3, 4))


def test_a_block_class_patched_after_compile_blocks_serves_its_new_forward(tmp_path):
    """``Block.forward`` replaced after ``compile_blocks`` (a library patching the class): the blocks' next calls run
    the new forward, compiled (the old forward's entry would give ``x @ W.T + b`` instead of its negation), and
    ``Regions.cached`` names the new cached methods; patched back, the first forward serves again. So do the blocks
    of a deep copy and of a pickled copy of the model (each its own ``BlockForward``, bound to its own block)."""
    original = _Patchable.forward
    try:
        _serve_the_patched_forward(tmp_path, original)
    finally:
        _Patchable.forward = original


class _Patchable(_Block):
    def forward(self, x):
        return self.lin(x)


def _serve_the_patched_forward(tmp_path, original):
    model = torch.nn.ModuleList([_Patchable(), _Patchable()]).eval()
    regions = compile_blocks(model, cache_dir=str(tmp_path))
    x = torch.randn(3, 4)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    for twin in copies:
        assert all(type(b.forward) is BlockForward and b.forward._module is b for b in twin)
        assert all(b.forward.life.pipeline.shares_loads for b in twin)
    models = [model, *copies]
    with torch.no_grad():
        assert all(torch.allclose(b(x), original(b, x)) for m in models for b in m)
        first = regions.cached
        _Patchable.forward = lambda self, x: -self.lin(x)
        assert all(torch.allclose(b(x), -original(b, x)) for m in models for b in m), "the old forward served"
        assert all(new is not old and new.entries == 1 for new, old in zip(regions.cached, first))
        _Patchable.forward = original
        assert all(torch.allclose(b(x), original(b, x)) for m in models for b in m)


def _checked_cold(cold: dict) -> None:
    assert cold["same"] and cold["calls"] == [4, 4, 4], cold
    assert (cold["kinds"], cold["blocks"], cold["entries"]) == (2, 5, 10)
    assert cold["compiles"] == cold["traces"] == 4, "one compile per block kind and signature"


def _cold(tmp_path) -> str:
    store = str(tmp_path / "store")
    _checked_cold(Script("regions_child.py", store).result(timeout=900))
    return store


@ahead("regions_cold_warm")
def _regions_cold_warm(tmp_path_factory, need) -> tuple[dict, dict]:
    store = str(tmp_path_factory.mktemp("regions") / "store")
    cold = Script("regions_child.py", store).result(timeout=900)
    return cold, Script("regions_child.py", store).result(timeout=600)


@pytest.fixture(scope="module")
def regions_cold_warm(ahead_jobs) -> tuple[dict, dict]:
    """Reports of tests/scripts/regions_child.py on one store: a cold process, then a warm one."""
    return ahead_jobs.value("regions_cold_warm")


def test_repeated_blocks_compile_once_per_kind_and_signature_cold_and_warm(regions_cold_warm):
    """Two block kinds x two signatures: 4 compiles for 5 blocks; a fresh process loads the 4 artifacts once each
    (shared by the blocks of a kind), traces and compiles nothing, and equals eager too."""
    cold, warm = regions_cold_warm
    _checked_cold(cold)
    assert warm["same"] and warm["entries"] == 10, warm
    assert (warm["compiles"], warm["traces"], warm["loads"]) == (0, 0, 4), "each artifact loaded once, shared"


@pytest.mark.slow
def test_a_patched_block_class_is_never_served_the_unpatched_entries(tmp_path):
    """A process whose ``Mlp.forward`` (inside both kinds) is patched after import, with the unpatched entries in
    the store: it compiles its own 4 and equals its eager twin (relu against gelu: a stale entry would differ)."""
    patched = Script("regions_child.py", _cold(tmp_path), "patched").result(timeout=900)
    assert patched["same"] and patched["compiles"] == 4 and patched["loads"] == 0, patched


@pytest.mark.slow
def test_decoder_layers_share_one_entry_per_gear_across_layers_and_models(tmp_path):
    """``regions="blocks"``: a 2-layer tiny Llama's generate() (prompt gears 16 and 32, decode) compiles 3 entries
    shared by both layers and equals eager (tokens, logits, every layer's keys, values and counter); an 8-layer
    Llama in a fresh process is served by those entries with nothing traced or compiled; a Mistral (same weights'
    layout, another layer class) and a Llama whose ``LlamaMLP.forward`` is patched trace their own entries and equal
    their eager twins (the Mistral's graph is Llama's: it may reuse the compiled artifact, never the entry)."""
    store = str(tmp_path / "store")
    cold = Script("run_hf_regions.py", store, "2").result(timeout=900)
    runs = {"cold": cold}
    assert cold["counters"]["compiles"] == 3 and cold["entries"] == [3, 3], cold
    assert cold["padding_refused"] is None and cold["padded_calls"] == 2, "the proof passes: prompts served padded"
    scripts = {"eight": Script("run_hf_regions.py", store, "8"),
               "mistral": Script("run_hf_regions.py", store, "2", "mistral"),
               "patched": Script("run_hf_regions.py", store, "2", "patched")}
    runs.update({name: script.result(timeout=900) for name, script in scripts.items()})
    for name, run in runs.items():
        for step in run["runs"]:
            assert step["tokens_equal"] and step["lengths_equal"], (name, run)
            assert step["max_logits_diff"] <= 1e-5 and step["cache_diff"] <= 1e-5, (name, run)
    eight = runs["eight"]
    assert eight["entries"] == [3] * 8 and eight["counters"]["loads"] == 3, eight
    # nothing traced or compiled for its entries; its Dynamo frames are its padding proof's (the layer count is in
    # the proof's key: an 8-layer model is proved on its own, tracing its layers, compiling nothing)
    assert eight["counters"]["compiles"] == 0 and eight["counters"]["traces"] == 0, eight
    assert eight["hooks"]["inductor_codegen"] == 0 and eight["padding_refused"] is None, eight
    assert runs["mistral"]["counters"]["traces"] == 3, "another layer class: entries of its own"
    assert runs["patched"]["counters"]["compiles"] == 3, "a patched layer: compiled anew, never the stale entry"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "mistral_sliding"])
def test_sliding_window_layers_by_region_equal_eager(tmp_path, name):
    """Gemma-3's sliding and full attention layers (one class, masks of their kind) and Mistral's sliding window,
    served by region as full-length layers: tokens, logits and caches equal eager's; every layer serves a call from
    the entries of its kind (3 gears)."""
    run = Script("run_hf_regions.py", str(tmp_path / "store"), "0", f"corpus={name}").result(timeout=900)
    for step in run["runs"]:
        assert step["tokens_equal"] and step["lengths_equal"], run
        assert step["max_logits_diff"] <= 1e-5 and step["cache_diff"] <= 1e-5, run
    assert set(run["entries"]) == {3} and run["counters"]["compiles"] >= 3, run
    assert run["padding_refused"] is None and run["padded_calls"] == 2, "the proof passes: prompts served padded"


def _served_exactly(run, op):
    """A run whose padding proof failed on ``op``: nothing padded, every step equal to eager (logits, caches)."""
    assert "refused" not in run and op in (run["padding_refused"] or ""), run
    assert run["padded_calls"] == 0, run
    for step in run["runs"]:
        assert step["tokens_equal"] and step["lengths_equal"], run
        assert step["max_logits_diff"] <= 1e-5 and step["cache_diff"] <= 1e-5, run


@pytest.mark.slow
@pytest.mark.parametrize("regions", ["blocks", "whole"])
def test_a_layer_mixing_positions_non_causally_is_served_exactly(tmp_path, regions):
    """A decoder layer whose MLP adds the mean over the call's positions (a custom model's layer): a prompt of 6
    right-padded to its 16-token gear would change every real position's mean (served padded before the proof:
    logits 0.34-0.46 and the caches 0.43-0.54 from eager's). The layer's padding proof finds the mean, so both modes
    serve every prompt at its exact length: equal to eager."""
    flags = ["mixing"] + (["whole"] if regions == "whole" else [])
    _served_exactly(Script("run_hf_regions.py", str(tmp_path / "store"), "2", *flags).result(timeout=900),
                    "aten.mean.dim")


@pytest.mark.slow
@pytest.mark.parametrize("flag, regions, op", [("batchmix", "blocks", "aten.mean.dim"),
                                               ("fullmask", "whole", "(KV cache)")])
def test_a_layer_mixing_rows_or_attending_past_its_position_is_served_exactly(tmp_path, flag, regions, op):
    """Three prompts (batch gear 4) through a layer whose MLP adds the mean over the batch's rows, or whose attention
    takes a full mask (every key: the pads' keys and the cache's unwritten positions too): the proof finds the op.
    The mean is served at exact sizes (prompts, batches, cache lengths), equal to eager; the full mask is refused
    with a ConfigError (served at exact sizes its logits were 0.39-0.56 from eager's, cause not found)."""
    flags = [flag, "rows=3"] + (["whole"] if regions == "whole" else [])
    run = Script("run_hf_regions.py", str(tmp_path / "store"), "2", *flags).result(timeout=900)
    if flag == "fullmask":      # served at exact sizes it still differs from eager (0.39-0.56 in the logits): refused
        assert "ConfigError" in run["refused"] and op in run["refused"], run
        return
    _served_exactly(run, op)


def test_enable_by_region_installs_and_disable_restores_the_layers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from gearcache import CompilerConfig
    from gearcache.integrations.transformers import disable, enable

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2)
    lm = LlamaForCausalLM(config).eval()
    with pytest.raises(ConfigError, match="'whole' or 'blocks'"):
        enable(lm, cache_dir=str(tmp_path), regions="layers")
    with pytest.raises(ConfigError, match=r"regions='whole'\) for CUDA graphs"):
        enable(lm, cache_dir=str(tmp_path), regions="blocks", config=CompilerConfig(mode="reduce-overhead"))
    hook = lm.model.layers[2].register_forward_hook(lambda *a: None)
    with pytest.raises(ConfigError, match="decoder layer 2 has forward hooks"):
        enable(lm, cache_dir=str(tmp_path), regions="blocks")
    assert not any("forward" in layer.__dict__ for layer in lm.model.layers), "a refusal leaves the model as it was"
    hook.remove()
    served = enable(lm, cache_dir=str(tmp_path), regions="blocks")
    assert served.layers == list(lm.model.layers) and len(served.regions) == 3
    assert all("forward" in layer.__dict__ for layer in lm.model.layers)
    names = {n for n, _ in served.regions[0].module.named_buffers()}
    assert any(n.startswith("block_LlamaDecoderLayer_") for n in names), "the layer class is a key factor"
    disable(lm)
    assert not any("forward" in layer.__dict__ for layer in lm.model.layers)
