"""gearcache.integrations.hf_prepare: after ``enable``, a decode step's inputs are prepared directly, as transformers'
own ``prepare_inputs_for_generation`` prepares them. Needs transformers (the "test" extra)."""
import pytest
import torch

from gearcache.integrations.hf_prepare import Prepare, same_inputs
from gearcache.integrations.transformers import enable


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module's tests: the same tiny model's entries and padding proof are compiled once."""
    return str(tmp_path_factory.mktemp("hf_prepare"))


def _tiny_llama(cls=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    return (cls or LlamaForCausalLM)(config).eval()


@pytest.mark.parametrize("batch", [1, 2])
def test_every_decode_step_is_prepared_as_transformers_prepares_it(store, batch):
    """At every decode step of ``generate()`` (left padding for a batch of 2: position ids from the mask), the inputs
    prepared directly equal transformers' own (keys, tensors' metadata and values, the other values), the direct path
    stays on after its one check, and the tokens equal the eager model's (a batch of 1 served padded to 2 rows)."""
    lm, eager = _tiny_llama(), _tiny_llama()
    enable(lm, cache_dir=store, batch_gears=[2])        # one batch gear: batches 1 and 2 share the entries
    prepare = lm.prepare_inputs_for_generation
    assert isinstance(prepare, Prepare) and prepare.direct
    direct, compared = prepare._decode_inputs, []

    def compare(input_ids, cache, kwargs):
        ours = direct(input_ids, cache, kwargs)
        compared.append(same_inputs(ours, prepare.original(input_ids, **kwargs)))
        return ours
    prepare._decode_inputs = compare
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]][:batch])
    mask = (ids != 0).long()
    options = dict(cache_implementation="static", max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        tokens = lm.generate(ids, attention_mask=mask, **options)
        expected = eager.generate(ids, attention_mask=mask, **options)
    assert torch.equal(tokens, expected)
    assert compared == [True] * 5, "5 decode steps after the prefill, each as transformers prepares it"
    assert prepare.direct and len(prepare.checked) == 1


def test_same_inputs_tells_apart_what_the_forward_would_see_differently():
    x = torch.arange(4).view(1, 4)
    base = {"input_ids": x, "use_cache": True, "logits_to_keep": 1}
    assert same_inputs(base, dict(base, input_ids=x.clone()))
    for other in [dict(base, input_ids=x + 1), dict(base, input_ids=x.float()), dict(base, input_ids=x.view(4, 1)),
                  dict(base, input_ids=x.view(4, 1).t()),                 # the same values, other strides
                  dict(base, use_cache=1), dict(base, logits_to_keep=0), {**base, "extra": None},
                  {k: v for k, v in base.items() if k != "use_cache"}, None]:
        assert not same_inputs(base, other), other


@pytest.mark.slow
def test_a_model_with_a_prepare_of_its_own_keeps_it(store):
    """A model class that overrides ``prepare_inputs_for_generation`` is never prepared directly: its method runs."""
    from transformers import LlamaForCausalLM

    calls = []

    class Own(LlamaForCausalLM):
        def prepare_inputs_for_generation(self, *args, **kwargs):
            calls.append(1)
            return super().prepare_inputs_for_generation(*args, **kwargs)

    lm, eager = _tiny_llama(Own), _tiny_llama()
    enable(lm, cache_dir=store)
    assert not lm.prepare_inputs_for_generation.direct
    ids = torch.tensor([[5, 6, 7]])
    options = dict(cache_implementation="static", max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        assert torch.equal(lm.generate(ids, **options), eager.generate(ids, **options))
    assert len(calls) == 4, "the prefill and 3 decode steps, each through the model's own method"


@pytest.mark.slow
def test_a_prepare_whose_source_was_not_read_against_is_served_by_transformers(store, monkeypatch):
    """The direct path rests on transformers' method having a source it was read against: where the installed
    ``GenerationMixin.prepare_inputs_for_generation`` has another (a patch, another version), ``enable`` leaves every
    call to it; the installed versions' source is one of the reviewed ones."""
    from transformers.generation.utils import GenerationMixin

    from gearcache.integrations import hf_compat

    assert hf_compat.prepare_source_reviewed(GenerationMixin.prepare_inputs_for_generation), \
        "this transformers' source is one hf_prepare was read against (a new version: read it, add its digest)"
    original = GenerationMixin.prepare_inputs_for_generation
    calls = []

    def patched(self, *args, **kwargs):     # another source: a different answer at decode steps would be possible
        calls.append(1)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", patched)
    lm, eager = _tiny_llama(), _tiny_llama()
    enable(lm, cache_dir=store)
    assert not lm.prepare_inputs_for_generation.direct
    ids = torch.tensor([[5, 6, 7]])
    options = dict(cache_implementation="static", max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        tokens = lm.generate(ids, **options)
    assert len(calls) == 4, "the prefill and 3 decode steps, each through the installed method"
    monkeypatch.undo()
    with torch.inference_mode():
        assert torch.equal(tokens, eager.generate(ids, **options))
