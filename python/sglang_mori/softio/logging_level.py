"""`set_log_level` and MORI_IO_LOG_LEVEL for the software engine's logger."""

from __future__ import annotations

import logging
import os

LOGGER_NAME = "sglang_mori.softio"
# MORI's level names (spdlog) mapped onto Python logging levels.
_LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "err": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": logging.CRITICAL + 10,
}


def set_log_level(level: str) -> None:
    try:
        value = _LEVELS[str(level).strip().lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; one of {sorted(_LEVELS)}") from None
    logging.getLogger(LOGGER_NAME).setLevel(value)


def apply_env_log_level() -> None:
    level = os.environ.get("MORI_IO_LOG_LEVEL", "").strip()
    if level:
        set_log_level(level)
