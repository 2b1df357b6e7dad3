"""The multi-process PD KV-transfer harness (see run.py): SGLang's real disaggregation classes in
one process per rank on CPU tensors, driven like the schedulers drive them, byte-exact checks."""

from harness.pd.run import (  # noqa: F401
    AuxBufferSpec,
    HarnessConfig,
    HarnessResult,
    KVLayout,
    ReadyInfo,
    RoomShape,
    run_transfer,
)
