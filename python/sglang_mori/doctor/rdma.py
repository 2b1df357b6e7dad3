"""Checks of the RDMA side: devices and ports, NIC drivers and verbs providers, GPU memory
registration (peer memory vs dmabuf) and hugepages for host buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .host import HostView
from .result import CheckResult, Status

# family -> (ethernet/core driver, RDMA driver, userspace verbs provider library)
NIC_FAMILIES: Dict[str, Tuple[str, str, str]] = {
    "mlx5": ("mlx5_core", "mlx5_ib", "libmlx5"),  # ConnectX-7
    "ionic": ("ionic", "ionic_rdma", "libionic"),  # AMD Pensando Pollara ("ainic")
    "bnxt": ("bnxt_en", "bnxt_re", "libbnxt_re"),  # Broadcom Thor2
}
PROVIDER_FIX = {
    "mlx5": "apt-get install rdma-core ibverbs-providers (libmlx5)",
    "ionic": "install libionic from AMD's AINIC (Pensando) repository (docker: NIC_BACKEND=ainic)",
    "bnxt": "install Broadcom's bnxt-rocelib (libbnxt_re) matching the bnxt_re driver (docker: NIC_BACKEND=bnxt)",
}
FAMILY_NOTES = {
    "mlx5": "kernel >= 6.3 without peer memory needs dmabuf registration (ROCm/mori#560)",
    "ionic": "reserve hugepages for host buffers; needs amd-mori without REMOTE_ATOMIC MRs (ROCm/mori#497)",
    "bnxt": "use Broadcom's libbnxt_re that matches the bnxt_re driver version",
}


@dataclass
class Port:
    device: str
    port: str
    state: str  # ACTIVE, DOWN, INIT, ARMED, ...
    link_layer: str
    rate: str
    has_roce_v2_gid: Optional[bool]  # None: not RoCE, or no gid_attrs to tell


def _roce_v2_gid(host: HostView, port_dir) -> Optional[bool]:
    types = port_dir / "gid_attrs" / "types"
    if not types.is_dir():
        return None
    for entry in types.iterdir():
        if (host.read(entry) or "").lower() == "roce v2":
            gid = host.read(port_dir / "gids" / entry.name) or ""
            if gid.replace("0", "").replace(":", ""):
                return True
    return False


def list_ports(host: HostView) -> List[Port]:
    root = host.sys_root / "class" / "infiniband"
    ports: List[Port] = []
    if not root.is_dir():
        return ports
    for dev in sorted(root.iterdir()):
        pdir = dev / "ports"
        if not pdir.is_dir():
            continue
        for p in sorted(pdir.iterdir(), key=lambda x: x.name):
            raw = host.read(p / "state") or "?"
            state = raw.split(":", 1)[-1].strip().upper()  # "4: ACTIVE" -> ACTIVE
            link = host.read(p / "link_layer") or "?"
            roce = _roce_v2_gid(host, p) if link.lower() == "ethernet" else None
            ports.append(Port(dev.name, p.name, state, link, host.read(p / "rate") or "?", roce))
    return ports


def device_driver(host: HostView, device: str) -> str:
    link = host.sys_root / "class" / "infiniband" / device / "device" / "driver"
    try:
        return link.resolve().name if link.exists() else "?"
    except OSError:
        return "?"


def selected_devices(env) -> Tuple[Optional[set], Optional[set]]:
    """MORI_RDMA_DEVICES: "a,b" picks devices, "^a,b" excludes them. Returns (include, exclude)."""
    raw = (env.get("MORI_RDMA_DEVICES") or "").strip()
    if not raw:
        return None, None
    if raw.startswith("^"):
        return None, {x.strip() for x in raw[1:].split(",") if x.strip()}
    return {x.strip() for x in raw.split(",") if x.strip()}, None


def check_ports(host: HostView, ports: List[Port]) -> List[CheckResult]:
    include, exclude = selected_devices(host.env)
    if not ports:
        return [CheckResult("rdma devices", Status.ABSENT, "no device in /sys/class/infiniband",
                            "single node: SGLANG_MORI_XGMI=1 (XGMI); multi-node needs RDMA "
                            "NICs with their drivers loaded")]
    results = []
    names = {p.device for p in ports}
    unknown = (include or set()) - names
    if unknown:
        results.append(CheckResult("MORI_RDMA_DEVICES", Status.FAIL,
                                   f"names {', '.join(sorted(unknown))}, not on this host "
                                   f"(have {', '.join(sorted(names))})",
                                   "fix MORI_RDMA_DEVICES / --disaggregation-ib-device"))
    for p in ports:
        used = (include is None or p.device in include) and not (exclude and p.device in exclude)
        desc = (f"{p.state}, {p.link_layer}, {p.rate}, driver {device_driver(host, p.device)}"
                + ("" if used else ", not selected by MORI_RDMA_DEVICES"))
        name = f"rdma {p.device}/{p.port}"
        if p.state != "ACTIVE":
            status = Status.FAIL if used else Status.WARN
            results.append(CheckResult(name, status, desc,
                                       f"bring the link up (cable, switch port; `ip link set <netdev> up` "
                                       f"for RoCE); `ibv_devinfo -d {p.device}`"))
        elif p.has_roce_v2_gid is False:
            results.append(CheckResult(name, Status.WARN, desc + ", no RoCE v2 GID",
                                       "give the netdev an IP address; or set MORI_IB_GID_INDEX"))
        else:
            results.append(CheckResult(name, Status.OK, desc))
    return results


def loaded_families(host: HostView) -> List[str]:
    return [f for f, (eth, rdma, _) in NIC_FAMILIES.items()
            if host.module_loaded(eth) or host.module_loaded(rdma)]


def check_nic_drivers(host: HostView) -> List[CheckResult]:
    results = []
    for family, (eth, rdma, provider) in NIC_FAMILIES.items():
        name = f"nic {family}"
        has_eth, has_rdma = host.module_loaded(eth), host.module_loaded(rdma)
        if not (has_eth or has_rdma):
            results.append(CheckResult(name, Status.ABSENT, f"{eth}/{rdma} not loaded"))
            continue
        if not has_rdma:
            results.append(CheckResult(name, Status.FAIL, f"{eth} loaded, RDMA driver {rdma} not loaded",
                                       f"modprobe {rdma}"))
            continue
        lib = host.find_library(provider)
        if lib is None:
            results.append(CheckResult(name, Status.FAIL,
                                       f"{eth}+{rdma} loaded, userspace provider {provider} not found: "
                                       "MORI aborts with no usable device",
                                       PROVIDER_FIX[family]))
            continue
        results.append(CheckResult(name, Status.OK,
                                   f"{eth}+{rdma} loaded, provider {lib.name}; note: {FAMILY_NOTES[family]}"))
    return results


def _kernel_has(config: Optional[str], option: str) -> Optional[bool]:
    if config is None:
        return None
    return f"{option}=y" in config.splitlines()


def check_registration(host: HostView, ports: List[Port], amd_gpus: int) -> CheckResult:
    """GPU memory is registered with the NIC through amdgpu_peermem or through dmabuf; with
    neither, ibv_reg_mr fails and older MORI aborts the whole process (ROCm/mori#481)."""
    name = "gpu mem registration"
    if not ports:
        return CheckResult(name, Status.ABSENT, "no RDMA device: GPU memory is not registered with a NIC")
    peermem = host.module_loaded("amdgpu_peermem")
    config = host.kernel_config()
    p2p = _kernel_has(config, "CONFIG_PCI_P2PDMA")
    notify = _kernel_has(config, "CONFIG_DMABUF_MOVE_NOTIFY")
    dmabuf_off = host.env.get("MORI_ENABLE_DMABUF_REG") == "0"
    dmabuf_kernel = p2p and notify
    nvidia = ", nvidia_peermem loaded (NVIDIA only, irrelevant to AMD GPUs)" \
        if host.module_loaded("nvidia_peermem") else ""
    kernel = ("unknown (no /proc/config.gz or /boot/config-*)" if config is None else
              f"P2PDMA={'y' if p2p else 'n'} DMABUF_MOVE_NOTIFY={'y' if notify else 'n'}")
    detail = f"amdgpu_peermem {'loaded' if peermem else 'not loaded'}; dmabuf kernel {kernel}" \
             + ("; MORI_ENABLE_DMABUF_REG=0" if dmabuf_off else "") + nvidia
    if dmabuf_kernel and not dmabuf_off:
        return CheckResult(name, Status.OK, detail)
    if peermem:
        return CheckResult(name, Status.OK, detail)
    fix = ("modprobe amdgpu_peermem, or a kernel with CONFIG_PCI_P2PDMA=y and "
           "CONFIG_DMABUF_MOVE_NOTIFY=y" + (" and unset MORI_ENABLE_DMABUF_REG=0" if dmabuf_off else ""))
    if config is None and not dmabuf_off:
        return CheckResult(name, Status.WARN, detail + ": cannot tell whether dmabuf works", fix)
    status = Status.FAIL if amd_gpus else Status.WARN
    return CheckResult(name, status, detail + ": no way to register GPU memory", fix)


def check_hugepages(host: HostView, ports: List[Port]) -> CheckResult:
    name = "hugepages"
    if not ports:
        return CheckResult(name, Status.ABSENT, "no RDMA device: host buffers are not registered with a NIC")
    root = host.sys_root / "kernel" / "mm" / "hugepages"
    pools = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            total = int(host.read(d / "nr_hugepages") or 0)
            free = int(host.read(d / "free_hugepages") or 0)
            if total:
                pools.append(f"{total} x {d.name.split('-', 1)[-1]} ({free} free)")
    thp = host.read(host.sys_root / "kernel" / "mm" / "transparent_hugepage" / "enabled") or "unknown"
    if pools:
        return CheckResult(name, Status.OK, "; ".join(pools) + f"; THP {thp}")
    ionic = "ionic" in loaded_families(host)
    return CheckResult(name, Status.FAIL if ionic else Status.WARN,
                       f"none reserved (THP {thp}): host buffers (aux, staging) use 4 KiB pages"
                       + ("; Pollara fails to register them and MORI aborts" if ionic else
                          "; NICs with small page caches lose bandwidth"),
                       "echo N > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages "
                       "(or vm.nr_hugepages in sysctl.conf)")
