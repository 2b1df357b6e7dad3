"""Process-wide MORI-IO settings, which MORI reads from environment variables at engine creation.

Only `engine/` sets `MORI_*` variables; the backend passes what SGLang and our config resolved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class EngineSettings:
    # Comma-separated RDMA device names for this rank's GPU, or None for MORI's own choice.
    rdma_devices: Optional[str] = None
    # Let MORI route same-host peers over XGMI.
    xgmi: bool = False

    @classmethod
    def for_gpu(
        cls,
        ib_device: Optional[str],
        gpu_id: int,
        xgmi: bool = False,
        resolve: Optional[Callable[[str, int], Optional[str]]] = None,
    ) -> "EngineSettings":
        """Settings for one GPU from `--disaggregation-ib-device`.

        The flag is a device list for every GPU ("mlx5_0,mlx5_1"), a JSON map per GPU
        ('{"0": "mlx5_0", "1": "mlx5_1"}') or the path of a .json file holding that map; SGLang's
        own parser (`get_ib_devices_for_gpu`, as Mooncake uses it) picks this GPU's devices and
        raises, naming the GPUs the map has, when it has none for this one.
        """
        devices = None
        if ib_device:
            if resolve is None:  # the manager passes SGLang's parser (backend/sglang_fields.py)
                raise ValueError("EngineSettings.for_gpu: a --disaggregation-ib-device value needs `resolve`")
            devices = resolve(ib_device, gpu_id)
        return cls(rdma_devices=devices or None, xgmi=xgmi)

    def apply(self) -> None:
        """Export the settings before the IOEngine is created (MORI reads them then)."""
        if self.rdma_devices:
            os.environ["MORI_RDMA_DEVICES"] = self.rdma_devices.replace(" ", "")
        if self.xgmi:
            os.environ["MORI_DISABLE_AUTO_XGMI"] = "0"  # inverted: only "0" enables auto-XGMI

    def describe_nic(self) -> str:
        return os.environ.get("MORI_RDMA_DEVICES", "auto")
