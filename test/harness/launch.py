"""Command lines and environments for SGLang servers and the router on a CPU-only host.

Every CPU workaround lives here, next to the flag it needs, with the reason; see
docs/research/sglang_cpu_feasibility.md (shared docs) for how each was found.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[2]
# The `vllm` import stub (scripts/cpu_stubs/vllm); SGLANG_MORI_CPU_STUBS overrides for installed copies.
CPU_STUBS = Path(os.environ.get("SGLANG_MORI_CPU_STUBS", REPO_ROOT / "scripts" / "cpu_stubs"))
HOST = "127.0.0.1"

# Backends the harness knows how to launch. `mori` is ours through the plugin (softio on CPU);
# `mori_builtin` is SGLang's own mori backend on softio via the mori shim (benchmark baseline);
# `mooncake_tcp` is Mooncake over TCP, the CPU-capable reference used to validate the harness.
BACKENDS = ("mori", "mori_builtin", "mooncake_tcp")
MORI_SHIM = Path(__file__).resolve().parent / "mori_shim"
# Test-only SGLang plugin that lets the prefill overlap scheduler and TP > 1 (gloo) run on CPU
# (cpu_hooks/README.md); a server loads it only with this directory on PYTHONPATH.
CPU_HOOKS = Path(__file__).resolve().parent / "cpu_hooks"


def plugin_pythonpath(*plugin_dirs: Path) -> str:
    """PYTHONPATH for servers that load test-only plugins: the plugins, the CPU stubs, the caller's."""
    paths = [str(d) for d in plugin_dirs] + [str(CPU_STUBS)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(paths)


@dataclass
class ServerOptions:
    """What the tests vary; everything else is fixed by the CPU recipe."""

    model_dir: Path
    chunked_prefill_size: int = 64
    max_total_tokens: int = 8192
    extra_env: Dict[str, str] = field(default_factory=dict)
    extra_args: List[str] = field(default_factory=list)
    # Run the prefill with SGLang's overlap scheduler; needs CPU_HOOKS on the servers' PYTHONPATH.
    prefill_overlap: bool = False
    # Flags for the prefill server only (e.g. --optimistic-prefill-attempts 1).
    prefill_extra_args: List[str] = field(default_factory=list)
    # --sleep-on-idle on every server: an idle SGLang scheduler otherwise spins on a full core, and
    # two of them take both cores of the CI host from the servers still starting, the restarted
    # prefill and the test's own traffic. SGLang sleeps only when its scheduler is fully idle (this
    # version's is_fully_idle counts the bootstrap, prealloc, transfer and prefill in-flight
    # queues), in a zmq poll that a new request or RPC ends at once: with a request anywhere in a
    # server, its loop runs as without the flag. The e2e tests set it; benchmarks keep the default.
    sleep_on_idle: bool = False


# Ports we hand out: above SGLang's own pick range for internal ports (22000-29999, see
# get_free_port_below_ephemeral) and below the kernel's ephemeral range (32768+), from which
# every bind(0) in the servers (zmq, transfer engines, client sockets) draws. A port chosen here can
# then not be taken by a server's internal socket in the 30-60 s before its owner binds it.
PORT_RANGE = (30000, 32700)


def pick_free_ports(count: int, avoid: Optional[set] = None) -> List[int]:
    """Distinct free TCP ports in PORT_RANGE, at least 10 apart, none in `avoid` (which is updated)."""
    avoid = avoid if avoid is not None else set()
    ports: List[int] = []
    rng = random.Random()
    for _ in range(2000):
        if len(ports) == count:
            break
        port = rng.randrange(*PORT_RANGE)
        if not any(abs(port - p) < 10 for p in avoid | set(ports)) and _is_free(port):
            ports.append(port)
    if len(ports) < count:
        raise RuntimeError(f"no {count} free ports in {PORT_RANGE}")
    avoid.update(ports)
    return ports


def _is_free(port: int) -> bool:
    # Loopback only; on Linux this bind also fails if a wildcard socket (Mooncake) holds the port.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def base_env(backend: Optional[str], extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    stubs = str(CPU_STUBS)
    paths = [stubs]
    if backend == "mori_builtin":
        # SGLang's own MoriKVManager imports `mori.io`; the shim re-exports softio under that name.
        paths.append(str(MORI_SHIM))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        {
            # SGLang imports vllm._custom_ops on a CPU-only host; the stub satisfies the import.
            "PYTHONPATH": os.pathsep.join(paths),
            # Nothing may come from a model hub: the tiny model is local.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # get_local_ip_auto() would otherwise pick the NIC address for bootstrap/transfer sockets.
            "SGLANG_HOST_IP": HOST,
            # One intra-op thread per server: the host has 2 cores and runs 3-4 servers, and all of
            # them should do the same float32 arithmetic (same reduction order).
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    # On SIGTERM a server's scheduler exits at once and its launcher then sleeps 5 s "before crash
    # diagnostics" (py-spy dumps and CUDA coredumps: neither exists on this host) before it exits;
    # every deployment's stop waited for that. Without them the launcher exits at once. A caller's
    # own setting wins.
    for name in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
        env.setdefault(name, "0")
    if backend in ("mori", "mori_builtin"):
        # The software engine with MORI-IO's API; real MORI-IO needs ROCm and an RDMA NIC.
        env["SGLANG_MORI_ENGINE"] = "soft"
    if backend == "mooncake_tcp":
        # MooncakeKVSender sets supports_host_tensor_indices, which sends page indices through
        # pinned memory and a torch.cuda.Event (prefill.py _send_kv_chunk): no NVIDIA driver here.
        # With this switch SGLang takes the plain host path instead; at CP size 1 the switch
        # changes nothing else (filter_kv_indices_for_cp_rank is the identity). Our sender does
        # not need it: it does not advertise host tensor indices at all.
        env["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    if backend == "mori_builtin":
        # Keep our plugin out so that `mori` resolves to SGLang's built-in classes.
        env["SGLANG_PLUGINS"] = "sglang_mori_disabled_for_baseline"
    if extra:
        env.update(extra)
    return env


def sglang_backend_flag(backend: str) -> str:
    return "mori" if backend == "mori_builtin" else backend


def _server_argv(opts: ServerOptions, port: int, host: str = HOST) -> List[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(opts.model_dir),
        "--device", "cpu",
        "--host", host,
        "--port", str(port),
        # float32 end to end: SGLang's "auto" turns a float32 config into float16 weights and KV.
        "--dtype", "float32",
        # The only attention backend that runs on CPU without SGLang's CPU kernels.
        "--attention-backend", "torch_native",
        # Without a cap SGLang sizes the KV pool from host RAM (15 GB, 160 s start-up).
        "--max-total-tokens", str(opts.max_total_tokens),
        # Small chunks so that long prompts are prefilled (and sent) in several chunks.
        "--chunked-prefill-size", str(opts.chunked_prefill_size),
        "--random-seed", "1234",
        "--log-level", "info",
    ] + (["--sleep-on-idle"] if opts.sleep_on_idle else []) + list(opts.extra_args)


def standalone_argv(opts: ServerOptions, port: int, host: str = HOST) -> List[str]:
    return _server_argv(opts, port, host)


def prefill_argv(opts: ServerOptions, port: int, bootstrap_port: int, backend: str,
                 host: str = HOST) -> List[str]:
    return _server_argv(opts, port, host) + [
        "--disaggregation-mode", "prefill",
        "--disaggregation-transfer-backend", sglang_backend_flag(backend),
        "--disaggregation-bootstrap-port", str(bootstrap_port),
    ] + ([] if opts.prefill_overlap else [
        # The overlap scheduler records a torch.cuda.Event on a radix-cache prefix hit (prefill.py,
        # maybe_send_cached_prefix_chunk), which fails without CUDA; CPU_HOOKS makes it run on CPU.
        "--disable-overlap-schedule",
    ]) + list(opts.prefill_extra_args)


def decode_argv(opts: ServerOptions, port: int, backend: str, host: str = HOST) -> List[str]:
    return _server_argv(opts, port, host) + [
        "--disaggregation-mode", "decode",
        "--disaggregation-transfer-backend", sglang_backend_flag(backend),
        # The default retraction backup ("host_pool") registers pinned host memory through
        # torch.cuda.cudart(), which needs an NVIDIA driver.
        "--disaggregation-decode-retraction-backup", "cpu_tensor",
    ]


def router_argv(port: int, prefill_port: int, bootstrap_port: int, decode_port: int,
                prometheus_port: int, host: str = HOST, prefill_host: str = HOST,
                decode_host: str = HOST, extra: Sequence[str] = ()) -> List[str]:
    """The router on `host`; the servers on their own hosts (all 127.0.0.1 unless a test puts them
    in separate network namespaces). `extra`: more router flags (harness.router_settings)."""
    return pd_router_argv(port, [(f"http://{prefill_host}:{prefill_port}", bootstrap_port)],
                          [f"http://{decode_host}:{decode_port}"], prometheus_port, host, extra)


def pd_router_argv(port: int, prefills: Sequence[Tuple[str, int]], decodes: Sequence[str],
                   prometheus_port: int, host: str = HOST, extra: Sequence[str] = ()) -> List[str]:
    """The router in front of any number of prefill (url, bootstrap port) and decode (url) servers."""
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, boot in prefills:
        argv += ["--prefill", url, str(boot)]
    for url in decodes:
        argv += ["--decode", url]
    return argv + [
        "--host", host,
        "--port", str(port),
        # The metrics listener defaults to 0.0.0.0:29000; keep it on its host and off shared ports.
        "--prometheus-host", host,
        "--prometheus-port", str(prometheus_port),
        "--log-level", "info",
        *extra,
    ]
