"""gearcache's logging: everything goes through ``logging.getLogger("gearcache")`` (and its children).

``GEARCACHE_LOG`` (a level name such as ``DEBUG``, ``INFO``, ``WARNING``, or a number) sets that logger's level and,
when it has no handler yet, gives it one ``StreamHandler`` (stderr). The root logger is never touched: with
``GEARCACHE_LOG`` unset, gearcache's records go wherever the application's own logging configuration sends them.
"""
from __future__ import annotations

import logging
import os
import warnings

LOGGER_NAME = "gearcache"
ENV_VAR = "GEARCACHE_LOG"
FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


def parse_level(raw: str) -> int | None:
    """``"info"`` / ``"INFO"`` / ``"20"`` -> 20; None for a value that names no level."""
    raw = raw.strip()
    if raw.lstrip("-").isdigit():
        return int(raw)
    level = logging.getLevelName(raw.upper())      # the name's number for a known name (3.10 has no mapping API)
    return level if isinstance(level, int) else None


def configure_from_env() -> None:
    """Apply ``GEARCACHE_LOG`` to the ``gearcache`` logger (no-op when it is unset or empty)."""
    raw = os.environ.get(ENV_VAR, "")
    if not raw.strip():
        return
    level = parse_level(raw)
    if level is None:
        warnings.warn(f"{ENV_VAR}={raw!r} is not a logging level; expected DEBUG, INFO, WARNING, ERROR, CRITICAL or "
                      f"a number. gearcache's logging is left as it is.", stacklevel=2)
        return
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
