"""torchair-compatible import path: ``from gearcache.inference import cache_compile, set_dim_gears``."""
from .api import cache_compile
from .config import CompilerConfig

__all__ = ["cache_compile", "CompilerConfig"]
