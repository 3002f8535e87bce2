import functools

import pytest
import torch
from torch import nn

import gearcache
from gearcache import CompilerConfig, ConfigError, cache_compile


class Net(nn.Module):
    def run(self, x):
        return x + 1


class NotAModule:
    def run(self, x):
        return x + 1


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class Decorated(nn.Module):
    @logged
    def run(self, x):
        return x + 1


def plain_function(x):
    return x + 1


def test_returns_cached_function(tmp_path):
    cf = cache_compile(Net().run, cache_dir=tmp_path)
    assert isinstance(cf, gearcache.CachedFunction)
    assert cf.name.endswith("test_api.Net.run")
    assert cf.entries == 0
    assert cf.store.root == tmp_path.resolve()
    assert cf.config == CompilerConfig()


@pytest.mark.parametrize("func, match", [
    (plain_function, r"func=.* is function, not a bound method"),
    (lambda x: x, r"func=.* is a lambda"),
    (Net.run, r"func=.* is function"),                         # unbound
    (NotAModule().run, r"func=.*NotAModule.run is a method of NotAModule, which is not a torch.nn.Module"),
    (Decorated().run, r"func=.*Decorated.run is wrapped by another decorator"),
    (torch.nn.functional.relu, r"func=.*not a bound method"),
])
def test_rejects_non_methods(tmp_path, func, match):
    with pytest.raises(ConfigError, match=match):
        cache_compile(func, cache_dir=tmp_path)


def test_rejects_cached_function(tmp_path):
    cf = cache_compile(Net().run, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="already a cache_compile'd method"):
        cache_compile(cf, cache_dir=tmp_path)


def test_rejects_unknown_keyword(tmp_path):
    with pytest.raises(ConfigError, match="unexpected keyword argument 'fullgraph'=True"):
        cache_compile(Net().run, cache_dir=tmp_path, fullgraph=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"config": {"mode": "default"}}, r"config=\{'mode': 'default'\}: expected a gearcache.CompilerConfig"),
    ({"dynamic": 1}, r"dynamic=1: expected True or False"),
    ({"dynamic": None}, r"dynamic=None"),
    ({"custom_decompositions": [torch.ops.aten.gelu.default]}, r"custom_decompositions=.*expected a dict"),
    ({"cache_dir": 3}, r"cache_dir=3: expected a folder path"),
    ({"global_rank": -1}, r"global_rank=-1: expected a non-negative int"),
    ({"tp_rank": -2}, r"tp_rank=-2"),
    ({"pp_rank": 1.0}, r"pp_rank=1.0"),
    ({"global_rank": True}, r"global_rank=True"),
])
def test_rejects_bad_arguments(tmp_path, kwargs, match):
    kwargs.setdefault("cache_dir", tmp_path)
    with pytest.raises(ConfigError, match=match):
        cache_compile(Net().run, **kwargs)


def test_rejects_cache_dir_that_is_a_file(tmp_path):
    path = tmp_path / "cache"
    path.write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder") as info:
        cache_compile(Net().run, cache_dir=str(path))
    assert str(path) in str(info.value)


def test_config_kept_and_dynamic_false_pins_signature(tmp_path):
    cfg = CompilerConfig(mode="max-autotune", lock_timeout_s=3)
    cf = cache_compile(Net().run, config=cfg, cache_dir=tmp_path)
    assert cf.config is cfg and cf.store.config.lock_timeout_s == 3
    pinned = cache_compile(Net().run, config=cfg, dynamic=False, cache_dir=tmp_path)
    assert pinned.config.on_new_signature == "error" and pinned.config.mode == "max-autotune"
    assert cfg.on_new_signature == "compile"                   # the caller's config is not mutated


def test_topology_from_arguments(tmp_path):
    cf = cache_compile(Net().run, cache_dir=tmp_path, global_rank=3, tp_rank=1, pp_rank=2)
    assert cf.topology.folder == "world4_rank3_tp1_pp2"        # world grows to hold the rank


@pytest.fixture
def no_dist_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return monkeypatch


def test_topology_defaults(tmp_path, no_dist_env):
    assert cache_compile(Net().run, cache_dir=tmp_path).topology.folder == "world1_rank0_tp0_pp0"


def test_topology_from_env(tmp_path, no_dist_env):
    no_dist_env.setenv("RANK", "5")
    no_dist_env.setenv("WORLD_SIZE", "8")
    assert cache_compile(Net().run, cache_dir=tmp_path).topology.folder == "world8_rank5_tp0_pp0"
    cf = cache_compile(Net().run, cache_dir=tmp_path, global_rank=2, tp_rank=0, pp_rank=1)
    assert cf.topology.folder == "world8_rank2_tp0_pp1"        # an argument wins over RANK


def test_topology_bad_env(tmp_path, no_dist_env):
    no_dist_env.setenv("WORLD_SIZE", "eight")
    with pytest.raises(ConfigError, match="WORLD_SIZE='eight' is not an integer"):
        cache_compile(Net().run, cache_dir=tmp_path)
