"""torchair-compatible import path: ``from gearcache.inference import cache_compile, set_dim_gears``."""
from .api import cache_compile
from .config import CompilerConfig
from .gears.plan import mark_static, set_dim_gears

__all__ = ["cache_compile", "CompilerConfig", "set_dim_gears", "mark_static"]
