import torch
from torch import nn

import gearcache
from gearcache._torch import versions as torch_versions
from gearcache import CompilerConfig
from gearcache.keys.key import build_key, factor_hash
from gearcache.call.signature import call_key, describe

FACTORS = [("format", 1), ("method", {"name": "m", "src": "abc"}), ("config", {"mode": "default"})]


def test_build_key_deterministic():
    key, hashes = build_key("entry", FACTORS)
    assert build_key("entry", list(FACTORS)) == (key, hashes)
    assert build_key("artifact", FACTORS)[0] == key          # ``kind`` is only a log label
    assert len(key) == 40 and int(key, 16) >= 0


def test_build_key_order_sensitive():
    assert build_key("entry", FACTORS)[0] != build_key("entry", FACTORS[::-1])[0]


def test_build_key_each_factor_matters():
    base = build_key("entry", FACTORS)[0]
    for i, (name, _) in enumerate(FACTORS):
        changed = list(FACTORS)
        changed[i] = (name, "something else")
        assert build_key("entry", changed)[0] != base, name
        renamed = list(FACTORS)
        renamed[i] = (name + "_", FACTORS[i][1])
        assert build_key("entry", renamed)[0] != base, name


def test_build_key_per_factor_hashes():
    _, hashes = build_key("entry", FACTORS)
    assert list(hashes) == [name for name, _ in FACTORS]
    assert hashes == {name: factor_hash(value) for name, value in FACTORS}
    assert factor_hash({"a": 1, "b": 2}) == factor_hash({"b": 2, "a": 1})    # canonical JSON
    assert factor_hash({"a": 1}) != factor_hash({"a": 2})


# ------------------------------------------------------------------------------------ entry-key sensitivity


class Net(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.lin = nn.Linear(4, width)
        self.register_buffer("scale", torch.ones(width))

    def run(self, x):
        return self.lin(x) * self.scale


class OtherNet(Net):
    def run(self, x):
        return self.lin(x) * self.scale + 1


OtherNet.__name__ = OtherNet.__qualname__ = Net.__qualname__   # same entry point name; only the source differs

X = (torch.zeros(2, 4),)


def entry_key(cache_dir, module=None, x=X, **kwargs):
    """``(ekey, factors)`` of ``module.run`` called on ``x``, computed without calling (compiling) it."""
    module = module if module is not None else Net()
    cf = gearcache.cache_compile(module.run, cache_dir=cache_dir, **kwargs)
    leaves, key = call_key(x, {})
    ekey, factors = cf.life.entry_key(describe(leaves, key), leaves)
    return ekey, factors


def changed(a, b):
    """The names of the factors whose hashes differ between two ``entry_key`` results."""
    assert a[1]["hashes"].keys() == b[1]["hashes"].keys()
    return {name for name in a[1]["hashes"] if a[1]["hashes"][name] != b[1]["hashes"][name]}


def test_entry_key_factors(tmp_path):
    ekey, factors = entry_key(tmp_path)
    assert list(factors["hashes"]) == ["format", "method", "signature", "module_state", "config", "decompositions",
                                       "global_state", "software", "devices", "process_groups"]
    assert factors["values"]["process_groups"] == [], "no torch.distributed group in this process"
    assert factors["values"]["method"]["name"].endswith("Net.run")
    assert entry_key(tmp_path) == (ekey, factors)


def test_entry_key_method_source(tmp_path):
    a, b = entry_key(tmp_path), entry_key(tmp_path, OtherNet())
    assert a[1]["values"]["method"]["name"] == b[1]["values"]["method"]["name"]
    assert a[0] != b[0] and changed(a, b) == {"method"}


def test_entry_key_signature(tmp_path):
    base = entry_key(tmp_path)
    for x in [(torch.zeros(3, 4),), (torch.zeros(2, 4, dtype=torch.float64),), (torch.zeros(4, 2).t(),)]:
        other = entry_key(tmp_path, x=x)
        assert other[0] != base[0] and changed(base, other) == {"signature"}, x


def test_entry_key_parameter_shape(tmp_path):
    a, b = entry_key(tmp_path, Net(4)), entry_key(tmp_path, Net(8))
    assert a[0] != b[0] and changed(a, b) == {"module_state"}
    c = entry_key(tmp_path, Net(4).double())                      # parameter dtype too
    assert c[0] != a[0] and changed(a, c) == {"module_state"}


def test_entry_key_mode(tmp_path):
    a = entry_key(tmp_path)
    b = entry_key(tmp_path, config=CompilerConfig(mode="max-autotune-no-cudagraphs"))
    c = entry_key(tmp_path, config=CompilerConfig(inductor_options={"coordinate_descent_tuning": True}))
    assert changed(a, b) == {"config"} and changed(a, c) == {"config"} and len({a[0], b[0], c[0]}) == 3


def test_entry_key_global_state(tmp_path):
    # Settings that change what is traced or generated; the SDPA backends too, though a running process's hot path
    # does not watch them (tests/test_signature.py): the entry key is computed afresh at each miss.
    base = entry_key(tmp_path)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = entry_key(tmp_path)
    assert changed(base, amp) == {"signature", "global_state"}         # the signature names autocast for messages
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(not before)
    try:
        sdp = entry_key(tmp_path)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)                                 # Inductor writes it into CPU kernels
    try:
        more_threads = entry_key(tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert changed(base, sdp) == changed(base, more_threads) == {"global_state"}
    assert len({base[0], amp[0], sdp[0], more_threads[0]}) == 4
    assert entry_key(tmp_path) == base


def _my_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def _my_gelu_exact(x):
    return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))


def test_entry_key_decompositions(tmp_path):
    gelu = torch.ops.aten.gelu.default
    a = entry_key(tmp_path)
    b = entry_key(tmp_path, custom_decompositions={gelu: _my_gelu})
    c = entry_key(tmp_path, custom_decompositions={gelu: _my_gelu_exact})
    assert changed(a, b) == {"decompositions"} and changed(b, c) == {"decompositions"}
    assert len({a[0], b[0], c[0]}) == 3


def test_entry_key_software_versions(tmp_path, monkeypatch):
    a = entry_key(tmp_path)
    real = torch_versions.software_versions()
    monkeypatch.setattr(torch_versions, "software_versions", lambda: {**real, "torch": "9.9.9"})
    b = entry_key(tmp_path)
    monkeypatch.setattr(torch_versions, "software_versions", lambda: {**real, "triton": "0.0.1"})
    c = entry_key(tmp_path)
    assert changed(a, b) == {"software"} and changed(a, c) == {"software"} and len({a[0], b[0], c[0]}) == 3


def test_entry_key_ignores_runtime_config(tmp_path):
    base = entry_key(tmp_path)[0]
    assert entry_key(tmp_path, config=CompilerConfig(lock_timeout_s=0.5))[0] == base
    assert entry_key(tmp_path, config=CompilerConfig(on_new_signature="error"))[0] == base
    assert entry_key(tmp_path, dynamic=False)[0] == base
    cfg = CompilerConfig(inference_config={"dim_gears": {"x": {0: [1, 2]}}, "past_largest_gear": "eager"})
    assert entry_key(tmp_path, config=cfg)[0] == base


def test_entry_key_ignores_parameter_values(tmp_path):
    torch.manual_seed(0)
    net = Net()
    base = entry_key(tmp_path, net)[0]
    with torch.no_grad():
        net.lin.weight.add_(1.0)
        net.scale.mul_(3.0)
    assert entry_key(tmp_path, net)[0] == base
    assert entry_key(tmp_path, Net())[0] == base                      # a fresh random init
    assert entry_key(tmp_path / "elsewhere")[0] == base               # nor the cache folder


def test_artifact_text_without_the_device_index():
    from gearcache.keys.key import without_device_index

    code = "x = torch.ones(3, device = device(type='cuda', index={i})); y = x.to('cuda:{i}')"
    free = {i: without_device_index(code.format(i=i), i) for i in (0, 1, 7)}
    assert free[0] == free[1] == free[7] and "cuda:*" in free[0] and "index=" not in free[0]
    assert without_device_index("a on cuda:1, b on cuda:0", 1) is None       # two GPUs: every index stays
    assert without_device_index(code.format(i=2), 3) is None                  # the graph names another GPU
    assert without_device_index('[[2, 3], "cpu"]', 0) == '[[2, 3], "cpu"]'
    for pinned in ("y = x.to(0)", "y = torch.ones(3, device = 0)", "y = x.cuda(0)", "d = torch.device('cuda', 0)"):
        assert without_device_index(pinned, 0) is None, pinned                # a GPU meant whatever the caller's


def test_the_cpu_device_factor_names_the_isa_extensions_inductor_builds_for(tmp_path):
    """Inductor adds -mavx512bf16, -mavx512vnni, -mamx-* when the CPU has them: a kernel built so may not run on a CPU
    of the same ATen capability that lacks one, so the key's device factor names each extension this CPU has."""
    device = entry_key(tmp_path)[1]["values"]["devices"][0]
    assert device == torch_versions.device_capability("cpu")
    capability = torch.backends.cpu.get_cpu_capability()
    assert device.startswith("cpu:") and f":{capability}" in device
    has = {name for name in torch_versions.CPU_ISA_EXTRAS
           if getattr(torch.cpu, f"_is_{name}_supported", lambda: False)()}
    named = set(device.split(":")[-1].split("+")[1:])
    assert named == has


# Each key function pinned against the value the code before keys/key.py computed them all gave for a fixed input:
# caches written before must still hit. A change here is a cache-invalidating change (bump FORMAT_VERSION).
PIN_ENV = {"decompositions": [["aten.silu.default", "d" * 64]], "global_state": {"autocast": False},
           "software": {"torch": "2.5.0", "python": "3.11.7"}, "devices": [[8, 0]], "process_groups": []}
PIN_CONFIG = {"mode": "default", "options": {}}
PIN_METHOD = {"method_name": "M.forward", "method_digest": "a" * 64}
PIN_STATE = [["param", "w", [3, 3], "torch.float32", "cpu", [3, 1]]]


def test_entry_key_value_pinned():
    from gearcache.keys.key import ENTRY_FACTORS, FORMAT_VERSION, entry_key
    assert FORMAT_VERSION == 7
    key, factors = entry_key(**PIN_METHOD, signature={"leaves": [["tensor", [2, 3], "torch.float32"]]},
                             module_state=PIN_STATE, config=PIN_CONFIG, environment=PIN_ENV)
    assert key == "afaeea75d5ccb35e5fb8ea81f0020d328d344e11"
    assert list(factors["values"]) == list(factors["hashes"]) == list(ENTRY_FACTORS)


def test_artifact_keys_values_pinned():
    from gearcache.keys.key import artifact_key, device_bound_artifact_key
    code = "def forward(self, x):\n    return x.to('cuda:1')\n"
    parts = dict(graph_code=code, graph_constants=[["w", "e" * 64 + "[3]"]],
                 inputs=[[[2, 3], [3, 1], "torch.float32", "cuda:1"]], config=PIN_CONFIG, environment=PIN_ENV)
    assert artifact_key(**parts)[0] == "e60f12a12cee6197245f8e4cc1187a89646976dd"
    assert artifact_key(**parts, device_index=1)[0] == "4002342a7d7b1c605386d247a071b829d62b7a46"
    assert artifact_key(**parts, device_index=0)[0] == "e60f12a12cee6197245f8e4cc1187a89646976dd"  # names another GPU
    assert device_bound_artifact_key("f" * 40, 1)[0] == "6c0274e15b6d564b4429cd0f0aae00365230af21"


def test_gear_plan_key_value_pinned():
    from gearcache.keys.key import gear_plan_key
    key = gear_plan_key(**PIN_METHOD, structure="('tuple', 1)", plan_format=3, marks=[[0, 0, [1, 2, 4], None]],
                        merge_policy="merge", module_state=PIN_STATE, global_state={"autocast": False},
                        software={"torch": "2.5.0", "python": "3.11.7"})
    assert key == "95ac7641094f90a483fdb0492f33cd4fbfd9331c"
