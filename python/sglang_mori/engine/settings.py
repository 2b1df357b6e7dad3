"""Process-wide MORI-IO settings, which MORI reads from environment variables at engine creation.

Only `engine/` sets `MORI_*` variables; the backend passes what SGLang and our config resolved.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

logger = logging.getLogger(__name__)

RDMA_DEVICES_ENV = "MORI_RDMA_DEVICES"
# The value apply() exported last, so that a second manager in this process (a role switch) does not
# mistake our own export for the user's setting.
_exported_devices: Optional[str] = None


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
        """Export the settings before the IOEngine is created (MORI reads them then).

        A `MORI_RDMA_DEVICES` the user set wins over `--disaggregation-ib-device` (it may say what
        the flag cannot, such as an exclusion `^mlx5_8`); which one is used is logged.
        """
        global _exported_devices
        user = os.environ.get(RDMA_DEVICES_ENV, "").strip()
        if user and user == _exported_devices:
            user = ""  # our own export from an earlier manager in this process
        flag = self.rdma_devices.replace(" ", "") if self.rdma_devices else ""
        if user:
            if flag and flag != user:
                logger.warning("sglang-mori: RDMA devices %s=%s from the environment win over "
                               "--disaggregation-ib-device (%s for this GPU)", RDMA_DEVICES_ENV, user, flag)
            else:
                logger.info("sglang-mori: RDMA devices %s=%s from the environment", RDMA_DEVICES_ENV, user)
        elif flag:
            os.environ[RDMA_DEVICES_ENV] = _exported_devices = flag
            logger.info("sglang-mori: RDMA devices %s from --disaggregation-ib-device", flag)
        if self.xgmi:
            os.environ["MORI_DISABLE_AUTO_XGMI"] = "0"  # inverted: only "0" enables auto-XGMI

    def describe_nic(self) -> str:
        return os.environ.get(RDMA_DEVICES_ENV) or "auto"
