"""Per-process SGLang set-up for harness workers: what a scheduler process does before it builds
its KV manager, minus the model.

Order matters and mirrors SGLang: environment first, then `load_plugins()` (how sglang_mori gets
in), then server arguments published into `runtime_context` with this process's TP placement, the
way `run_scheduler_process` does it. The managers read their parallel layout (attention TP size and
rank, DP, PP) from there, not from KVArgs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Dict

from harness.pd.config import HarnessConfig


# A `mori` package that re-exports softio under MORI-IO's module names.
MORI_SHIM = Path(__file__).resolve().parents[1] / "mori_shim"


def sglang_backend(backend: str) -> str:
    """The --disaggregation-transfer-backend value for a harness backend name."""
    return "mori" if backend == "mori-builtin" else backend


def worker_env(cfg: HarnessConfig, side: str) -> Dict[str, str]:
    """Environment of a worker of `side` ('prefill', 'decode', 'bootstrap'); cfg.env and then
    cfg.<side>_env override the defaults."""
    timeout = str(int(cfg.sglang_timeout_s))
    env = {
        # get_local_ip_auto() honours it: managers and engines bind loopback, not the NIC.
        "SGLANG_HOST_IP": cfg.host,
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": timeout,
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": timeout,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if cfg.backend == "mooncake":
        env["MC_FORCE_TCP"] = "1"  # what --disaggregation-transfer-backend mooncake_tcp sets
    else:
        env["SGLANG_MORI_ENGINE"] = "soft"
    if cfg.backend == "mori-builtin":
        # Keep our plugin out (a whitelist naming no installed plugin), so `mori` resolves to
        # SGLang's built-in classes; they import `mori.io`, which the shim maps to softio.
        env["SGLANG_PLUGINS"] = "sglang_mori_disabled_for_baseline"
    env.update(cfg.env)
    env.update({"prefill": cfg.prefill_env, "decode": cfg.decode_env}.get(side, {}))
    return env


def write_model_dir(cfg: HarnessConfig, path: Path) -> Path:
    """A config.json-only Llama whose KV geometry matches the layout (weights are never loaded)."""
    lay = cfg.layout
    heads = max(lay.total_kv_heads, 1) * 2
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * lay.head_dim,
        "intermediate_size": 2 * heads * lay.head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": lay.total_kv_heads,
        "head_dim": lay.head_dim,
        "num_hidden_layers": lay.num_layers,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def parallel_args(cfg: HarnessConfig, server_mode: str) -> list:
    """--tp-size / --dp-size / --enable-dp-attention / --pp-size for one side, as a user runs it."""
    attn_tp = cfg.prefill_tp if server_mode == "prefill" else cfg.decode_tp
    dp = cfg.prefill_dp if server_mode == "prefill" else cfg.decode_dp
    pp = cfg.prefill_pp if server_mode == "prefill" else 1
    cp = cfg.prefill_cp if server_mode == "prefill" else 1
    args = ["--tp-size", str(attn_tp * cp * dp)]
    if cp > 1:
        args += ["--enable-prefill-cp", "--attn-cp-size", str(cp), "--cp-strategy", "zigzag"]
    if dp > 1:
        args += ["--dp-size", str(dp), "--enable-dp-attention"]
    if pp > 1:
        args += ["--pp-size", str(pp)]
    if server_mode == "decode" and cfg.decode_dcp > 1:
        # runtime_context then gives each rank attn_dcp_rank = tp_rank % dcp_size, which
        # CommonKVManager reads into dcp_size / dcp_rank (common/conn.py).
        args += ["--dcp-size", str(cfg.decode_dcp)]
    if server_mode == "prefill" and dp > 1 and cfg.prefill_dp_routing == "query":
        # Not follow_bootstrap_room: each sender registers its room's DP rank with the bootstrap
        # server, and decode asks for it (/register_dp_rank, /query_dp_ranks).
        args += ["--load-balance-method", "round_robin"]
    return args


def setup_process(
    cfg: HarnessConfig, model_dir: str, mode: str, tp_rank: int, bootstrap_port: int,
    pp_rank: int = 0, pp_links=None,
):
    """Prepare this process to host a KV manager (mode 'prefill'/'decode') or the bootstrap server
    (mode 'bootstrap'); returns the published ServerArgs. `tp_rank` is the rank in the whole TP
    group (with DP attention: dp_rank * attention TP + attention-TP rank), `pp_rank` the prefill's
    PP stage and `pp_links` its pipes to the other stages (see PipePPGroup)."""
    os.environ.update(worker_env(cfg, mode))
    if cfg.backend == "mori-builtin" and str(MORI_SHIM) not in sys.path:
        sys.path.insert(0, str(MORI_SHIM))
    logging.basicConfig(level=getattr(logging, cfg.log_level, logging.WARNING))
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    server_mode = "prefill" if mode == "bootstrap" else mode
    args = [
        "--model-path", model_dir,
        "--device", "cpu",
        "--host", cfg.host,
        "--load-format", "dummy",
        *parallel_args(cfg, server_mode),
        "--page-size", str(cfg.layout.page_size),
        "--disaggregation-mode", server_mode,
        "--disaggregation-transfer-backend", sglang_backend(cfg.backend),
        "--disaggregation-bootstrap-port", str(bootstrap_port),
    ]  # fmt: skip
    server_args = prepare_server_args(args)
    server_args.resolve_once()
    if mode == "bootstrap":
        # The bootstrap server lives in the launcher (tokenizer) process in SGLang.
        publish(server_args, role="tokenizer")
        return server_args
    from sglang.srt.runtime_context import spawn_world_rank

    dp_size = cfg.prefill_dp if mode == "prefill" else cfg.decode_dp
    attn_tp = cfg.prefill_tp if mode == "prefill" else cfg.decode_tp
    cp = cfg.prefill_cp if mode == "prefill" else 1
    # As run_scheduler_process: the WORLD rank from TP and PP ranks; the DP controller's rank
    # (with DP attention, the attention-DP rank) or None without one. SGLang orders the TP group
    # as (DP, CP, attention TP).
    ranks = SpawnRanks(
        world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank),
        dp_rank=tp_rank // (attn_tp * cp) if dp_size > 1 else None,
        gpu_id=0,
    )
    publish(server_args, role="scheduler", ranks=ranks)
    # Prefill managers read get_parallel().pp_group (PPConsensusStore needs it for PP > 1).
    pp_size = cfg.prefill_pp if mode == "prefill" else 1
    group = _SinglePPGroup() if pp_size == 1 else PipePPGroup(pp_rank, pp_size, pp_links, cfg.startup_timeout_s)
    get_parallel().override_permanently(pp_group=group)
    if cfg.backend == "mooncake":
        # SGLang creates the shared Mooncake engine in its model-parallel set-up, not in the manager.
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        init_mooncake_transfer_engine(hostname=cfg.host, gpu_id=0, ib_device=None)
    return server_args


class _SinglePPGroup:
    """Stands in for a 1-rank pipeline-parallel group."""

    world_size = 1
    rank_in_group = 0
    is_first_rank = True
    is_last_rank = True


class PipePPGroup:
    """Stands in for the prefill's pipeline-parallel group of one (DP, TP) rank: the only
    collective a KV manager runs on it is PPConsensusStore's broadcast_object from stage 0 (its
    listening address), carried over multiprocessing pipes the orchestrator made (stage 0 holds
    one per later stage, each later stage one to stage 0)."""

    def __init__(self, rank: int, size: int, links, timeout_s: float):
        self.rank_in_group, self.world_size = rank, size
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self._links, self._timeout_s = list(links or []), timeout_s

    def broadcast_object(self, obj=None, src: int = 0):
        if src != 0:
            raise NotImplementedError("the harness PP group broadcasts from stage 0 only")
        if self.rank_in_group == 0:
            for link in self._links:
                link.send(obj)
            return obj
        (link,) = self._links
        if not link.poll(self._timeout_s):
            raise TimeoutError(f"PP stage {self.rank_in_group}: no broadcast from stage 0")
        return link.recv()


def kv_classes(backend: str):
    """(KVArgs, manager, sender, receiver, bootstrap server) classes, through get_kv_class."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    tb = TransferBackend(sglang_backend(backend))
    return tuple(
        get_kv_class(tb, t)
        for t in (
            KVClassType.KVARGS,
            KVClassType.MANAGER,
            KVClassType.SENDER,
            KVClassType.RECEIVER,
            KVClassType.BOOTSTRAP_SERVER,
        )
    )
