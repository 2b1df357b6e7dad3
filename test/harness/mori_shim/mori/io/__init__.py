"""`mori.io` on softio: the same classes and functions amd-mori 1.2.4 exports."""

from mori.cpp import *  # noqa: F401,F403 - the mori.cpp names mori.io re-exports
from sglang_mori.softio import TORCH_DEVICE_TYPE_MAP, IOEngine, IOEngineSession  # noqa: F401
