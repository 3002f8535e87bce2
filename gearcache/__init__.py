"""gearcache: start PyTorch 2 models already compiled, serve any input shape without recompiling or guard checks.

    from gearcache import cache_compile, CompilerConfig
    self.cached_forward = cache_compile(self._forward)      # in an nn.Module's __init__
"""
from .log import configure_from_env as _configure_logging
from .api import cache_compile
from .compiling.torch_compile_backend import get_backend
from .cached_function import CachedFunction
from .regions import Regions, compile_blocks
from .config import CompilerConfig, InferenceConfig
from .counters import counters
from .graphs.cuda_graphs import release_graphs
from .graphs.graphed_entry import mark_static_address
from .compiling.background import wait as wait_for_background_compiles
from .gears.plan import mark_static, set_dim_gears
from .errors import (CacheCorruptionError, ConfigError, DispatchModeError, GearcacheError, GearLoadError,
                     GradModeError,
                     GraphBreakError, LockTimeoutError, ProcessGroupMismatchError, SignatureMismatchError,
                     UnsupportedInputError, UntrustedCacheError, PaddingUnsafeError, PastLargestGearError,
                     RankDivergenceError, RankWaitError)

_configure_logging()
__version__ = "0.1.0"

__all__ = ["cache_compile", "compile_blocks", "Regions",
           "wait_for_background_compiles", "get_backend", "mark_static_address", "release_graphs",
           "set_dim_gears",
           "mark_static",
           "PastLargestGearError", "PaddingUnsafeError", "CachedFunction", "CompilerConfig", "InferenceConfig",
           "counters", "GearcacheError", "ConfigError", "GraphBreakError", "GradModeError", "SignatureMismatchError",
           "UnsupportedInputError", "CacheCorruptionError", "UntrustedCacheError", "LockTimeoutError",
           "ProcessGroupMismatchError", "RankWaitError", "RankDivergenceError", "GearLoadError",
           "DispatchModeError"]
