"""Every profile in configs/ loads with CompilerConfig.from_file and says what its comments promise (no compiling)."""
from pathlib import Path

import pytest

from gearcache import CompilerConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_every_file_loads():
    files = sorted(p for p in CONFIGS.iterdir() if p.is_file())
    assert {p.name for p in files} >= {"llm_decode.toml", "llm_prefill.toml", "vision_batch.toml",
                                       "max_autotune.json"}
    for path in files:
        assert isinstance(CompilerConfig.from_file(path), CompilerConfig), path.name


def test_llm_decode():
    ic = CompilerConfig.from_file(CONFIGS / "llm_decode.toml").inference_config
    assert ic.dynamic_gears_merge_policy == "zip"
    assert ic.past_largest_gear == "error"
    # argument names of examples/hf_llama.py's CachedLlama.decode(input_ids, kv, pos)
    assert ic.dim_gears == {"input_ids": {0: BUCKETS}, "kv": {2: BUCKETS}}


def test_llm_prefill():
    ic = CompilerConfig.from_file(CONFIGS / "llm_prefill.toml").inference_config
    assert ic.dynamic_gears_merge_policy == "product"
    batch, length = ic.dim_gears["input_ids"][0], ic.dim_gears["input_ids"][1]
    assert ic.dim_gears["kv"] == {2: batch}           # lockstep with input_ids' batch dim: the same gears
    assert length == [8, 16, 32, 64] and max(length) <= 128    # fits examples/hf_llama.py's MAX_LEN
    assert ic.pad_values == {"input_ids": -1.0}


def test_vision_batch():
    cfg = CompilerConfig.from_file(CONFIGS / "vision_batch.toml")
    assert cfg.inference_config.dim_gears == {"pixel_values": {0: [1, 2, 4, 8, 16, 32]}}
    assert cfg.inference_config.dynamic_gears_merge_policy == "zip"
    assert cfg.mode == "default"


def test_max_autotune():
    cfg = CompilerConfig.from_file(CONFIGS / "max_autotune.json")
    assert cfg.mode == "max-autotune-no-cudagraphs"
    assert cfg.inductor_options == {"coordinate_descent_tuning": True}
    assert cfg.compile_factors() != CompilerConfig().compile_factors()     # the mode and option change the code


@pytest.mark.parametrize("name", ["llm_decode.toml", "llm_prefill.toml", "vision_batch.toml"])
def test_gear_fields_stay_out_of_the_key(name):
    """Gears steer dispatch only: a profile's compile factors equal the defaults'."""
    assert CompilerConfig.from_file(CONFIGS / name).compile_factors() == CompilerConfig().compile_factors()
