import json
import os

import pydantic
import pytest
import torch

import gearcache
from gearcache import CompilerConfig, InferenceConfig, counters
from gearcache.config import normalise_dim_gears


def test_defaults():
    cfg = CompilerConfig()
    assert cfg.mode == "default"
    assert cfg.inductor_options == {}
    assert cfg.on_new_signature == "compile"
    assert cfg.check_signature is True
    assert cfg.lock_timeout_s == 900.0
    inf = cfg.inference_config
    assert isinstance(inf, InferenceConfig)
    assert (inf.dynamic_gears_merge_policy, inf.dim_gears, inf.pad_values) == ("zip", {}, {})
    assert (inf.past_largest_gear, inf.padding_check) == ("error", "refuse")


def test_defaults_are_not_shared():
    a, b = CompilerConfig(), CompilerConfig()
    a.inductor_options["max_autotune"] = True
    assert b.inductor_options == {}
    assert a.inference_config is not b.inference_config


@pytest.mark.parametrize("target, field, value", [
    ("inference", "dynamic_gears_merge_policy", "bogus"),
    ("inference", "past_largest_gear", "sometimes"),
    ("top", "mode", "x"),
    ("top", "on_new_signature", "ignore"),
    ("top", "lock_timeout_s", 0),
    ("top", "lock_timeout_s", -1.0),
])
def test_validation_on_assignment(target, field, value):
    cfg = CompilerConfig()
    obj = cfg.inference_config if target == "inference" else cfg
    before = getattr(obj, field)
    with pytest.raises(pydantic.ValidationError, match=field):
        setattr(obj, field, value)
    assert getattr(obj, field) == before


def test_valid_assignment_is_kept():
    cfg = CompilerConfig()
    cfg.mode = "max-autotune"
    cfg.inference_config.dynamic_gears_merge_policy = "product"
    assert cfg.mode == "max-autotune"
    assert cfg.inference_config.dynamic_gears_merge_policy == "product"


def test_extra_fields_forbidden():
    with pytest.raises(pydantic.ValidationError, match="mdoe"):
        CompilerConfig(mdoe="default")
    with pytest.raises(pydantic.ValidationError, match="gears"):
        InferenceConfig(gears={})
    with pytest.raises(pydantic.ValidationError):
        CompilerConfig().no_such_field = True


def test_dim_gears_normalised():
    inf = InferenceConfig(dim_gears={"x": {"0": [8, 1, 4, 4, 2], 1: 16}})
    assert inf.dim_gears == {"x": {0: [1, 2, 4, 8], 1: [16]}}
    assert all(isinstance(d, int) for d in inf.dim_gears["x"])


def test_dim_gears_normalised_on_assignment():
    cfg = CompilerConfig()
    cfg.inference_config.dim_gears = {"ids": {"-1": [4, 2, 2]}}
    assert cfg.inference_config.dim_gears == {"ids": {-1: [2, 4]}}


@pytest.mark.parametrize("sizes", [[0, 1], [-2], [1.5], ["4"], [True], []])
def test_dim_gears_bad_sizes_name_the_argument(sizes):
    with pytest.raises(pydantic.ValidationError, match=r"dim_gears\['x'\]\[0\]"):
        InferenceConfig(dim_gears={"x": {0: sizes}})


def test_dim_gears_bad_dims_and_shapes():
    with pytest.raises(pydantic.ValidationError, match=r"dim_gears\['x'\]: dims must be integers"):
        InferenceConfig(dim_gears={"x": {"batch": [1, 2]}})
    with pytest.raises(pydantic.ValidationError, match=r"dim_gears\['x'\]: expected a dict"):
        InferenceConfig(dim_gears={"x": [1, 2]})
    with pytest.raises(pydantic.ValidationError, match="dim_gears"):
        InferenceConfig(dim_gears=[1, 2])


def test_normalise_dim_gears_helper():
    assert normalise_dim_gears({0: 4}) == {0: [4]}
    with pytest.raises(ValueError, match=r"my_arg\[1\]"):
        normalise_dim_gears({1: [3, 0]}, "my_arg")


def test_unknown_inductor_option_rejected():
    with pytest.raises(pydantic.ValidationError, match="'not_a_setting' is not a torch._inductor.config setting"):
        CompilerConfig(inductor_options={"not_a_setting": 1})
    cfg = CompilerConfig(inductor_options={"coordinate_descent_tuning": True})
    assert cfg.inductor_options == {"coordinate_descent_tuning": True}


@pytest.mark.parametrize("name", ["triton.cudagraphs", "triton.cudagraph_trees"])
def test_cudagraph_options_rejected(name):
    with pytest.raises(pydantic.ValidationError, match="reduce-overhead"):
        CompilerConfig(inductor_options={name: True})
    cfg = CompilerConfig()
    with pytest.raises(pydantic.ValidationError, match=name):
        cfg.inductor_options = {name: False}


def test_compile_factors_change_with_mode_and_inductor_options():
    base = CompilerConfig().compile_factors()
    assert CompilerConfig(mode="max-autotune").compile_factors() != base
    assert CompilerConfig(mode="reduce-overhead").compile_factors() == base    # CUDA graphs are not compiled code
    assert CompilerConfig(inductor_options={"max_autotune": True}).compile_factors() != base
    assert (CompilerConfig(inductor_options={"max_autotune": True}).compile_factors()
            != CompilerConfig(inductor_options={"max_autotune": False}).compile_factors())
    json.dumps(base)        # JSON-able


def test_compile_factors_hold_the_inductor_and_aot_settings_set_in_code():
    """A compile runs under the process's Inductor and AOTAutograd settings: one set in code to another value than
    it has without is a factor (named, its value's repr); set back, or set to the value it has without, it is not
    (and the factors are as before: no ``compiler_settings`` field). Settings torch's caches ignore (thread counts)
    and those gearcache patches around a compile are never factors."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    base = CompilerConfig().compile_factors()
    assert "compiler_settings" not in base
    with inductor_config.patch(emulate_precision_casts=not inductor_config.emulate_precision_casts):
        changed = CompilerConfig().compile_factors()
    assert changed["compiler_settings"] == {"inductor": {
        "emulate_precision_casts": repr(not inductor_config.emulate_precision_casts)}}
    assert {k: v for k, v in changed.items() if k != "compiler_settings"} == base
    with functorch_config.patch(view_replay_for_aliased_outputs=not functorch_config.view_replay_for_aliased_outputs):
        assert set(CompilerConfig().compile_factors()["compiler_settings"]) == {"functorch"}
    with inductor_config.patch(emulate_precision_casts=inductor_config.emulate_precision_casts, compile_threads=1,
                               cpp_cache_precompile_headers=not inductor_config.cpp_cache_precompile_headers):
        assert CompilerConfig().compile_factors() == base
    assert CompilerConfig().compile_factors() == base


def test_compile_factors_hold_the_inductor_environment_variables(monkeypatch):
    """Inductor reads most settings' defaults from ``TORCHINDUCTOR_*`` variables at import, which the settings set in
    code do not show: the variables that may change the code are a factor of their own (named, their values as
    given); those that cannot (cache folders, thread counts) are not, and without any the factors are as before."""
    for name in [n for n in os.environ if n.startswith("TORCHINDUCTOR_")]:
        monkeypatch.delenv(name)
    base = CompilerConfig().compile_factors()
    assert "compiler_environment" not in base
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    assert CompilerConfig().compile_factors() == base
    monkeypatch.setenv("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "1")
    changed = CompilerConfig().compile_factors()
    assert changed["compiler_environment"] == {"TORCHINDUCTOR_EMULATE_PRECISION_CASTS": "1"}
    assert {k: v for k, v in changed.items() if k != "compiler_environment"} == base
    monkeypatch.setenv("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "0")
    assert CompilerConfig().compile_factors() != changed


def test_a_thread_under_the_settings_context_compiles_under_the_callers_settings():
    """A compile in another thread (a warm-up's, a background compile's settling) runs under
    ``settings_context()`` taken in the caller: there the settings, and so the factors of the key the caller
    computed, are the caller's (torch 2.13 keeps a setting set in code in a ContextVar, which a new thread does not
    see on its own)."""
    import threading

    import torch._inductor.config as inductor_config

    from gearcache._torch import inductor

    seen: list[object] = []

    def read() -> None:
        seen.append((inductor_config.emulate_precision_casts, CompilerConfig().compile_factors()))

    flipped = not inductor_config.emulate_precision_casts
    with inductor_config.patch(emulate_precision_casts=flipped):
        mine = CompilerConfig().compile_factors()
        thread = threading.Thread(target=inductor.settings_context().run, args=(read,))
        thread.start()
        thread.join()
    assert seen == [(flipped, mine)] and "compiler_settings" in mine


def test_compile_factors_hold_the_custom_inductor_passes():
    """Torch's caches key a custom pass by its ``uuid()`` and leave its setting out of the settings they read: so did
    the factors. A pass set is a factor (its class and uuid), another uuid another factor; none, as before."""
    import torch._inductor.config as inductor_config

    from models import MulToAdd

    base = CompilerConfig().compile_factors()
    with inductor_config.patch(post_grad_custom_post_pass=MulToAdd()):
        first = CompilerConfig().compile_factors()
    with inductor_config.patch(post_grad_custom_post_pass=MulToAdd("2")):
        second = CompilerConfig().compile_factors()
    passes = first["compiler_settings"]["custom_passes"]
    assert list(passes) == ["post_grad_custom_post_pass"] and "mul-to-add-1" in passes["post_grad_custom_post_pass"]
    assert "MulToAdd" in passes["post_grad_custom_post_pass"]
    assert second != first != base and CompilerConfig().compile_factors() == base


@pytest.mark.slow
def test_an_inductor_environment_variable_gets_entries_of_its_own(tmp_path):
    """A process started with ``TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1`` loaded the entry another process compiled
    without it: 0.125 off eager on a bfloat16 chain (its own compile is exact). The variables are a factor of the
    keys: it compiles its own entry, equal to eager, and a process without the variable loads the first again."""
    from conftest import run_script

    first = run_script("run_bf16_chain.py", str(tmp_path))
    assert first["compiles"] == 1 and first["diff"] > 0.01         # Inductor keeps float32 without emulation
    emulated = run_script("run_bf16_chain.py", str(tmp_path), env={"TORCHINDUCTOR_EMULATE_PRECISION_CASTS": "1"})
    assert emulated["emulate"] == "1"
    assert emulated["compiles"] == 1 and emulated["loads"] == 0
    assert emulated["diff"] == 0.0
    again = run_script("run_bf16_chain.py", str(tmp_path))
    assert again["compiles"] == 0 and again["loads"] == 1 and again["diff"] == first["diff"]


def test_a_custom_inductor_pass_gets_entries_of_its_own(tmp_path):
    """A process that set ``torch._inductor.config.post_grad_custom_post_pass`` compiled its entry with the pass (the
    user's choice: x * y became x + y, 8 for 3 and 5); another without the pass loaded that entry: 8 where eager
    gives 15. Custom passes (by class and ``uuid()``) are a factor of the keys now."""
    import torch._inductor.config as inductor_config

    from models import MulToAdd, Product

    x, y = torch.full((4,), 3.0), torch.full((4,), 5.0)
    with torch.inference_mode():
        with inductor_config.patch(post_grad_custom_post_pass=MulToAdd()), counters.expect(compiles=1):
            assert Product(tmp_path).cached(x, y).tolist() == [8.0] * 4
        with counters.expect(compiles=1, loads=0):
            m = Product(tmp_path)
            assert torch.equal(m.cached(x, y), m.fwd(x, y))
        with inductor_config.patch(post_grad_custom_post_pass=MulToAdd()), counters.expect(compiles=0, loads=1):
            assert Product(tmp_path).cached(x, y).tolist() == [8.0] * 4


def test_a_setting_torch_keeps_as_its_plain_value_reads_as_torch_2_11_keeps_it():
    """torch 2.11's config entries hold the value set in code itself (unset: torch's sentinel), later versions a
    ContextVar of it. Both readings give the same factors: a dict-valued setting left at its ``{}`` (which has a
    ``get`` of its own: every entry key failed on 2.11) is no factor, a setting set in code is."""
    import torch._inductor.config as inductor_config
    from torch.utils import _config_module

    from gearcache._torch import inductor

    name = "emulate_precision_casts"
    flipped = not inductor_config.emulate_precision_casts
    entry = inductor_config._config[name]
    dict_entries = [e for e in inductor_config._config.values() if e.default == {} and isinstance(e.default, dict)]
    saved = [(e, e.user_override) for e in (entry, *dict_entries)]
    try:                                  # torch's own reads need the ContextVar: none until restored
        entry.user_override = _config_module._UNSET_SENTINEL
        unset = inductor._overridden(entry)
        entry.user_override = flipped
        for e in dict_entries:
            e.user_override = {}
        factors = CompilerConfig().compile_factors()
    finally:
        for e, old in saved:
            e.user_override = old
    assert dict_entries and unset is inductor._NOT_OVERRIDDEN
    assert factors["compiler_settings"] == {"inductor": {name: repr(flipped)}}


def test_compile_factors_ignore_runtime_fields():
    base = CompilerConfig().compile_factors()
    other = CompilerConfig(lock_timeout_s=1.0, on_new_signature="error", check_signature=False,
                           inference_config={"dynamic_gears_merge_policy": "product",
                                             "dim_gears": {"x": {0: [1, 2]}}, "past_largest_gear": "eager"})
    assert other.compile_factors() == base


def test_compile_factors_independent_of_option_order():
    a = CompilerConfig(inductor_options={"max_autotune": True, "coordinate_descent_tuning": True})
    b = CompilerConfig(inductor_options={"coordinate_descent_tuning": True, "max_autotune": True})
    assert a.compile_factors() == b.compile_factors()


def test_from_json(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"mode": "max-autotune", "lock_timeout_s": 5,
                                "inference_config": {"dim_gears": {"x": {"0": [4, 1, 2]}}}}))
    cfg = CompilerConfig.from_file(path)
    assert cfg.mode == "max-autotune"
    assert cfg.lock_timeout_s == 5.0
    assert cfg.inference_config.dim_gears == {"x": {0: [1, 2, 4]}}


def test_from_toml(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text('on_new_signature = "error"\n'
                    "[inductor_options]\ncoordinate_descent_tuning = true\n"
                    '[inference_config]\ndynamic_gears_merge_policy = "product"\n'
                    '[inference_config.dim_gears.ids]\n"1" = [16, 8, 8]\n')
    cfg = CompilerConfig.from_file(str(path))
    assert cfg.on_new_signature == "error"
    assert cfg.inductor_options == {"coordinate_descent_tuning": True}
    assert cfg.inference_config.dynamic_gears_merge_policy == "product"
    assert cfg.inference_config.dim_gears == {"ids": {1: [8, 16]}}


def test_from_file_validates_contents(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"mode": "fast"}))
    with pytest.raises(pydantic.ValidationError, match="mode"):
        CompilerConfig.from_file(path)


def test_from_file_bad_suffix(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("mode: default\n")
    with pytest.raises(gearcache.ConfigError, match=r"must end in \.json or \.toml") as info:
        CompilerConfig.from_file(path)
    assert str(path) in str(info.value)


def test_from_file_missing(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(gearcache.ConfigError, match="is not a file") as info:
        CompilerConfig.from_file(path)
    assert str(path) in str(info.value)
    with pytest.raises(gearcache.ConfigError, match="is not a file"):
        CompilerConfig.from_file(tmp_path)      # a folder is not a file either


def test_a_setting_merged_away_names_its_replacement():
    """``inference_config.verify_padding`` was a second way to say ``padding_check="verify"`` (issue #37): a saved
    config that still sets it is refused with the setting to use, not with pydantic's bare "extra inputs"."""
    with pytest.raises(ValueError, match=r"verify_padding=True: merged into padding_check.*padding_check='verify'"):
        CompilerConfig.model_validate({"inference_config": {"verify_padding": True}})
    with pytest.raises(ValueError, match="padding_check='verify'"):
        CompilerConfig().inference_config.verify_padding = False
