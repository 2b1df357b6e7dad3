"""Entry points for a transfer process that fails during start-up (spawned children import this
module by name, so it lives beside the tests and sets the fault up inside the child)."""

from __future__ import annotations

import os


def registration_raises(spec, channel) -> None:
    """The engine refuses to register the imported pools (as `ibv_reg_mr` of an address it cannot
    pin would)."""
    from sglang_mori.softio import engine as softio_engine

    def refuse(self, ptr, size, device_id, mem_loc):
        raise RuntimeError(f"injected: cannot register {size} bytes at {ptr:#x}")

    softio_engine.IOEngine.register_memory = refuse
    from sglang_mori.transfer_process.child import main

    main(spec, channel)


def crashes_while_proving(spec, channel) -> None:
    """The process dies inside the registration proof (ROCr's dma-buf export of an imported
    pointer dereferences a null region: a crash, not an exception)."""
    from sglang_mori.transfer_process import proof

    def crash(*args, **kwargs):
        os.abort()

    proof.prove = crash
    from sglang_mori.transfer_process.child import main

    main(spec, channel)
