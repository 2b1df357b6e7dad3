"""Run every check in a fixed order (software, GPUs, RDMA, settings, bootstrap)."""

from __future__ import annotations

from typing import List, Optional, Sequence

from . import bootstrap, rdma, settings, software
from .host import HostView
from .result import CheckResult


def run_checks(host: HostView, bootstrap_addrs: Sequence[str] = (),
               mori_timeout_s: Optional[float] = None) -> List[CheckResult]:
    amd_gpus = software.count_amd_gpus(host)
    ports = rdma.list_ports(host)
    probe = software.probe_mori(host, **({"timeout_s": mori_timeout_s} if mori_timeout_s else {}))
    results = [
        software.check_sglang(),
        software.check_mori(probe),
        software.check_engine(host, probe, amd_gpus),
        software.check_rocm_library(host, "libamdhip64"),
        software.check_rocm_library(host, "libhsa-runtime64"),
        software.check_amd_gpus(host, amd_gpus),
    ]
    results += rdma.check_ports(host, ports)
    results += rdma.check_nic_drivers(host)
    results.append(rdma.check_registration(host, ports, amd_gpus))
    results.append(rdma.check_hugepages(host, ports))
    results.append(settings.check_xgmi(host, len(ports), amd_gpus))
    results.append(settings.check_mori_io_overrides(host))
    results += settings.check_host_address(host)
    results += settings.check_config(host)
    for addr in bootstrap_addrs:
        results.append(bootstrap.check_bootstrap(addr, host.timeout_s))
    return results
