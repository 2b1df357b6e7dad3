"""Stand-in `mori` package that maps MORI-IO's Python API onto softio (benchmarks only)."""

import logging

__version__ = "1.2.4+softio"

logging.getLogger("sglang_mori.softio").warning(
    "`mori` is the softio shim (%s): MORI-IO is emulated over TCP on CPU memory", __file__)
