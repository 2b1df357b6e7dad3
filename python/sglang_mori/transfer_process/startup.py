"""Whether this prefill rank can hand its transfers to a transfer process, and starting it.

The prototype covers chunk-wise transfers of plain KV pools. Where the deployment needs more, or a
pool cannot be mapped in another process, the switch is refused with the reason: logged as a
warning, kept on the manager (`transfer_process_refusal`, in debug snapshots), and the transfers
stay in the scheduler's process as with the switch off. Never silently.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from sglang_mori.backend import sglang_fields as fields
from sglang_mori.backend.plans import encode_layout
from sglang_mori.transfer_process.pools import PoolImport, PoolNotImportable, describe

logger = logging.getLogger(__name__)


def deployment_refusal(config, cp, pp_size: int, defers_decode_allocation: bool, state_ptrs) -> Optional[str]:
    """Why this deployment needs the in-process path, or None."""
    if config.layerwise != "off":
        return "layer-wise streaming needs the forward's per-layer events, which stay in the scheduler's process"
    if cp.cp_size > 1 or cp.sharded:
        return "context parallelism and KV sharding are not carried by the prototype"
    if pp_size > 1:
        return "pipeline parallelism (PP consensus on statuses) is not carried by the prototype"
    if defers_decode_allocation:
        return "SGLang's prefill_complete allocation policy is not carried by the prototype"
    if any(state_ptrs or []):
        return "state pools (hybrid models) are not carried by the prototype"
    return None


def check(config, cp, pp_size: int, defers_decode_allocation: bool, state_ptrs, kv_ptrs, kv_lens,
          gpu_id: int) -> Tuple[Optional[str], List[PoolImport]]:
    """(refusal, how the child maps the KV pools)."""
    reason = deployment_refusal(config, cp, pp_size, defers_decode_allocation, state_ptrs)
    if reason is not None:
        return reason, []
    on_gpu = fields.kv_on_gpu()
    try:
        return None, describe(kv_ptrs, kv_lens, on_gpu, gpu_id if on_gpu else -1)
    except PoolNotImportable as exc:
        return str(exc), []


def start(config, layout, kv: List[PoolImport], gpu_id: int, local_ip: str, aux_buffers: int, adapter,
          read_aux, owns_aux: bool):
    """Spawn this rank's transfer process; returns the scheduler's side (a TransferProcessService)."""
    from sglang_mori.transfer_process.child import ChildSpec
    from sglang_mori.transfer_process.client import TransferProcess
    from sglang_mori.transfer_process.scheduler_service import TransferProcessService

    on_gpu = fields.kv_on_gpu()
    spec = ChildSpec(
        config=config, layout=encode_layout(layout), kv=kv, on_gpu=on_gpu, device=gpu_id if on_gpu else -1,
        host=config.host or local_ip, control_host=local_ip, table_name="", table_slots=0, parent_pid=0,
        prefill_rank=adapter.prefill_rank, aux_buffers=aux_buffers, owns_aux=owns_aux,
        deferred_release=adapter.deferred_release, bootstrap_timeout_s=adapter.bootstrap_timeout_s,
        decode_release_timeout_s=adapter.decode_release_timeout_s, log_level=logging.getLogger().level,
    )
    process = TransferProcess(spec, slots=max(4096, 2 * config.max_queued_chunks))
    return TransferProcessService(process, adapter, read_aux, owns_aux=owns_aux)
