"""SGLang plugin entry point (group `sglang.srt.plugins`); filled in by the backend work."""

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    logger.info("sglang_mori plugin loaded")
