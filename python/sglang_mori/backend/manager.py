"""MoriKVManager: the SGLang-facing shell, one per scheduler process and role.

SGLang's CommonKVManager provides bootstrap registration, the parallel-info handshake, room
statuses, heartbeats and abort bookkeeping. This class validates our configuration, starts the
MORI-IO engine, registers the KV buffers, and assembles the role's service from explicit parts
(prefill/parts.py, decode/service.py). It holds no room logic: every SGLang entry point below
forwards to the service.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import Counter
from typing import List, Optional

from sglang_mori import protocol
from sglang_mori.backend import room_status
from sglang_mori.backend import sglang_compat as compat
from sglang_mori.backend import sglang_fields as fields
from sglang_mori.backend.sglang_compat import DisaggregationMode, KVArgs
from sglang_mori.backend.failure_reasons import PROTOCOL
from sglang_mori.backend.messenger import Messenger
from sglang_mori.backend.peers import InflightBudget, PeerRegistry
from sglang_mori.backend.plans import KVPlanner, LocalBuffers, local_layout
from sglang_mori.backend.sglang_adapter import SGLangAdapter
from sglang_mori.config import MoriConfig, mori_env_overrides, transfer_shard_count
from sglang_mori.engine import EngineSettings, TransferEngine, load_io_module
from sglang_mori.metrics import create_transfer_metrics

logger = logging.getLogger(__name__)

# The statuses at which check_status reads our socket before answering (inbox.py): a prefill room
# waiting for decode's destinations; a decode room waiting for prefill's Success or Failed.
PREFILL_INBOX_WAITS = (room_status.BOOTSTRAPPING,)
DECODE_INBOX_WAITS = (room_status.BOOTSTRAPPING, room_status.WAITING_FOR_INPUT, room_status.TRANSFERRING)


class MoriKVManager(compat.CompatKVManager):
    # Decode holds aborted pages until our ACK says every write into them is terminal.
    supports_deferred_decode_kv_release = True
    # teardown() releases every thread, socket, registration and the engine (runtime P<->D switch).
    supports_role_switch = True
    reports_transfer_latency = True
    kv_status_msg_carries_reason = True
    # The statuses at which check_status reads our socket first (set once the service runs).
    _inbox_waits: tuple = ()
    # SGLANG_MORI_TRANSFER_PROCESS: the status sync check_status runs first, and why the switch
    # was refused (None: not refused, or off)
    _sync_status = None
    transfer_process_refusal: Optional[str] = None

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args,
                 is_mla_backend: Optional[bool] = False):
        # Validate our configuration before anything binds a socket or registers with bootstrap.
        self.mori_config = MoriConfig.from_env()
        for warning in mori_env_overrides(self.mori_config, os.environ):
            logger.warning("sglang-mori: %s", warning)
        # A transfer process serves decode's messages on its own port: bootstrap registration
        # waits until we know which port to advertise (register_to_bootstrap below).
        self._registration_waits = (self.mori_config.transfer_process
                                    and disaggregation_mode == DisaggregationMode.PREFILL)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.role = disaggregation_mode.value
        compat.check_manager(self, self.role)
        self.protocol_rejections: Counter = Counter()
        self.metrics = create_transfer_metrics(
            bool(server_args.enable_metrics), engine_type=self.role,
            tp_rank=self.attn_tp_rank, pp_rank=self.pp_rank or 0, dp_rank=self.system_dp_rank or 0,
        )
        self.layout = local_layout(fields.kv_args_view(args), self.attn_tp_size, self.attn_tp_rank,
                                   bool(is_mla_backend), self.dcp_size, self.dcp_rank)
        self.sglang = SGLangAdapter(self)
        handed_pools = self._transfer_process_pools() if self._registration_waits else None
        process_service = self._start_transfer_process(handed_pools) if handed_pools is not None else None
        if process_service is None:
            self.engine = self._start_engine()
            self.buffers = self._register_buffers()
        else:  # the transfer process owns the engine and the registrations
            self.engine, self.buffers = None, None
        self.messenger = Messenger(compat.zmq_context(self))
        self.layerwise = None  # the layer-wise session (prefill, SGLANG_MORI_LAYERWISE on/auto)
        if process_service is not None:
            self.service = process_service
            self._sync_status = self.service.sync
            self.rank_port = self.service.port  # decode's messages go to the transfer process
        elif disaggregation_mode == DisaggregationMode.PREFILL:
            self.service = self._build_prefill()
        else:
            self.service = self._build_decode()
            compat.start_heartbeat_checker(self)
        self.service.start()
        if self.mori_config.poll_reads:
            self._inbox_waits = (PREFILL_INBOX_WAITS if disaggregation_mode == DisaggregationMode.PREFILL
                                 else DECODE_INBOX_WAITS)
        if self.layerwise is not None:
            self.layerwise.start()
        if self._registration_waits:
            self._registration_waits = False
            self.register_to_bootstrap()
        if self.mori_config.gc_freeze:
            from sglang_mori.gc_tuning import freeze_startup_heap

            freeze_startup_heap(f"{self.role} tp{self.attn_tp_rank}")

    # --- assembly --------------------------------------------------------------------------
    def register_to_bootstrap(self):
        """SGLang registers this prefill rank while its manager is built; with a transfer process
        that waits until the process's control port is known (and happens once either way)."""
        if not self._registration_waits:
            super().register_to_bootstrap()

    def _transfer_process_pools(self):
        """How the transfer process maps the KV pools, or None (refused: logged, and kept in
        `transfer_process_refusal`) to keep the transfers in this process."""
        from sglang_mori.transfer_process import startup

        self.cp = fields.prefill_cp(self)
        args = self.kv_args
        reason, pools = startup.check(self.mori_config, self.cp, int(self.pp_size or 1),
                                      bool(getattr(self, "defer_decode_allocation", False)),
                                      args.state_data_ptrs, args.kv_data_ptrs, args.kv_data_lens, args.gpu_id)
        if reason is None:
            return pools
        self._refuse_transfer_process(reason)
        return None

    def _start_transfer_process(self, pools):
        """This rank's transfer process (its service), or None: it could not map, register or prove
        its pools, or died starting (the reason becomes `transfer_process_refusal`, logged, and the
        transfers stay in this process; a half-working child never serves traffic)."""
        from sglang_mori.transfer_process import startup
        from sglang_mori.transfer_process.client import TransferProcessError

        EngineSettings.for_gpu(self.kv_args.ib_device, self.kv_args.gpu_id, xgmi=self.mori_config.xgmi,
                               resolve=fields.ib_devices_for_gpu).apply()  # inherited by the child
        try:
            args = self.kv_args
            return startup.start(self.mori_config, self.layout, pools, args.gpu_id, self.local_ip,
                                 len(args.aux_data_ptrs), self.sglang, self._handoff_aux_reader(),
                                 self._owns_aux(self.cp))
        except TransferProcessError as exc:
            self._refuse_transfer_process(str(exc))
            return None

    def _handoff_aux_reader(self):
        """The transfer process's aux reader: the hand-off sends row views of SGLang's aux buffers
        (the kernel's copy is the only one), not `_read_aux`'s bytes."""
        from sglang_mori.transfer_process.aux_rows import AuxRows

        args = self.kv_args
        return AuxRows(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)

    def _refuse_transfer_process(self, reason: str) -> None:
        self.transfer_process_refusal = reason
        logger.warning("sglang-mori prefill tp%d: SGLANG_MORI_TRANSFER_PROCESS=on refused: %s; transfers stay "
                       "in the scheduler's process", self.attn_tp_rank, reason)

    def _build_prefill(self):
        from sglang_mori.backend.prefill.parts import PrefillParts
        from sglang_mori.backend.prefill.service import PrefillService

        cfg = self.mori_config
        cp = self.cp = fields.prefill_cp(self)
        kv_shard = (cp.kv_shard_rank, cp.kv_shard_size) if cp.sharded else (0, 1)
        if cfg.layerwise == "off":
            planner = KVPlanner(self.layout, self.buffers, kv_shard=kv_shard)
        else:
            from sglang_mori.backend.prefill.layerwise.assembly import layerwise_planner

            planner = layerwise_planner(cfg.layerwise, self.layout, self.buffers, kv_shard)
        parts = PrefillParts(
            config=cfg, engine=self.engine, local=self.buffers, planner=planner,
            peers=PeerRegistry(cfg.peer_fail_fast_s, InflightBudget.from_config(cfg)),
            messenger=self.messenger, metrics=self.metrics, sglang=self.sglang, read_aux=self._read_aux,
            control_socket=self.server_socket,
            dcp=(self.dcp_size, self.dcp_rank),
            owns_aux=self._owns_aux(cp), cp=cp,
        )
        service = PrefillService(parts, self.reject_message)
        if cfg.layerwise != "off":
            from sglang_mori.backend.prefill.layerwise.assembly import build_session

            self.layerwise = build_session(fields.deployment(self), self.kv_args.kv_data_ptrs, parts, service,
                                           self.layout)
        return service

    def _build_decode(self):
        from sglang_mori.backend.decode.reachability import BootstrapReachability
        from sglang_mori.backend.decode.service import AuxSlots, DecodeIdentity, DecodeParts, DecodeService

        args = self.kv_args
        self.reachability = BootstrapReachability()
        parts = DecodeParts(
            config=self.mori_config, engine=self.engine, local=self.buffers, layout=self.layout,
            identity=DecodeIdentity(self.local_ip, self.rank_port, self.attn_tp_size, self.attn_tp_rank,
                                    self.dcp_size, self.dcp_rank,
                                    cp_all_ranks=bool(self.enable_all_cp_ranks_for_transfer)),
            aux=AuxSlots(list(args.aux_data_ptrs), list(args.aux_item_lens), list(args.aux_data_lens)),
            messenger=self.messenger, metrics=self.metrics, sglang=self.sglang, control_socket=self.server_socket,
        )
        return DecodeService(parts, self.reject_message)

    def _start_engine(self) -> TransferEngine:
        cfg = self.mori_config
        # --disaggregation-ib-device: a device list or a per-GPU map (JSON or a file), for this GPU.
        settings = EngineSettings.for_gpu(self.kv_args.ib_device, self.kv_args.gpu_id, xgmi=cfg.xgmi,
                                          resolve=fields.ib_devices_for_gpu)
        settings.apply()
        io = load_io_module(cfg.engine)
        engine = TransferEngine(
            io, role=self.role, host=cfg.host or self.local_ip, qp_per_transfer=cfg.qp_per_transfer,
            post_batch_size=cfg.post_batch_size, num_workers=cfg.num_workers,
            enable_notification=cfg.enable_notification,
        )
        logger.info("sglang-mori %s tp%d: engine=%s (%s) host=%s port=%s zmq_port=%s nic=%s qp=%d workers=%d "
                    "shards=%d timeout_ms=%d inflight_bytes_per_peer=%d", self.role, self.attn_tp_rank, cfg.engine,
                    io.__name__, engine.desc.host, engine.desc.port, self.rank_port, settings.describe_nic(),
                    cfg.qp_per_transfer, cfg.num_workers, transfer_shard_count(cfg), cfg.transfer_timeout_ms,
                    cfg.max_inflight_bytes_per_peer)
        return engine

    def _register_buffers(self) -> LocalBuffers:
        args = self.kv_args
        on_gpu = fields.kv_on_gpu()
        device = args.gpu_id if on_gpu else -1
        return LocalBuffers(
            kv=[self.engine.register(ptr, size, device, on_gpu) for ptr, size in zip(args.kv_data_ptrs, args.kv_data_lens)],
            # SGLang keeps aux (metadata) buffers in host memory.
            aux=[self.engine.register(ptr, size, -1, False) for ptr, size in zip(args.aux_data_ptrs, args.aux_data_lens)],
            # Zero-length state buffers stay as None so indices keep lining up.
            state=[[self.engine.register(ptr, size, device, on_gpu) for ptr, size in zip(ptrs, lens)]
                   for ptrs, lens in zip(args.state_data_ptrs or [], args.state_data_lens or [])],
        )

    def _owns_aux(self, cp) -> bool:
        """Aux is computed by the last pipeline stage, alike on its CP and shard ranks."""
        last_stage = (self.pp_rank or 0) == (self.pp_size or 1) - 1
        return last_stage and cp.owns_aux

    def prepare_send_state_indices(self, state_indices):
        """State every CP rank holds alike goes from CP rank 0 only (SGLang's rule for it)."""
        if state_indices is not None and self.cp.skips_replicated_state:
            return None
        return state_indices

    def _read_aux(self, aux_index: Optional[int]) -> Optional[list]:
        """This room's aux (metadata) items as bytes, one per aux buffer; they ride on Success."""
        if aux_index is None:
            return None
        args = self.kv_args
        return [ctypes.string_at(ptr + aux_index * item_len, item_len)
                for ptr, item_len in zip(args.aux_data_ptrs, args.aux_item_lens)]

    # --- bootstrap reachability (decode) -------------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's single attempt, remembering failures per address: when SGLang gives up on an
        unreachable bootstrap server it aborts the rooms waiting on it, and MoriKVReceiver.abort()
        then names the cause instead of "Aborted by AbortReq."."""
        ok = super().try_ensure_parallel_info(bootstrap_addr)
        self.reachability.record(bootstrap_addr, ok)
        return ok

    def bootstrap_unreachable_reason(self, bootstrap_addr: str) -> Optional[str]:
        """Why rooms on `bootstrap_addr` never got past the parallel-info fetch, or None."""
        if bootstrap_addr in self.prefill_info_table:
            return None
        return self.reachability.reason(bootstrap_addr)

    def forget_bootstrap_failures(self, bootstrap_addr: str) -> None:
        """No room waits on `bootstrap_addr` any more: drop its failure count."""
        if not self.addr_to_rooms_tracker.get(bootstrap_addr):
            self.reachability.forget(bootstrap_addr)

    # --- SGLang's polls ---------------------------------------------------------------------------
    def check_status(self, bootstrap_room: int):
        """SGLang's sender and receiver poll() read a room's status here. A room still waiting for
        the other side's message (prefill: decode's destinations; decode: prefill's Success or
        Failed) first has the socket read on this thread (inbox.py), so the message's effect is
        seen in this poll rather than after our reading thread wins the GIL."""
        if self._sync_status is not None:
            self._sync_status(bootstrap_room)
        status = super().check_status(bootstrap_room)
        # (read again only when the poll applied something: decode's poll returns 0 for an empty
        # look, most steps; a poll that returns nothing to count (None) is read again)
        if status in self._inbox_waits and self.service.poll_inbox() != 0:
            status = super().check_status(bootstrap_room)
        return status

    def check_status_pp_consensus(self, bootstrap_room: int):
        status = super().check_status_pp_consensus(bootstrap_room)
        if status in self._inbox_waits and self.service.poll_inbox() != 0:
            status = super().check_status_pp_consensus(bootstrap_room)
        return status

    # --- messages ------------------------------------------------------------------------------
    def reject_message(self, error: protocol.ProtocolError, origin: str) -> None:
        """Count every rejection; log the first of each kind loudly, then every 100th."""
        self.protocol_rejections[error.reason] += 1
        self.metrics.failure(PROTOCOL)
        count = self.protocol_rejections[error.reason]
        if count == 1 or count % 100 == 0:
            logger.warning("sglang-mori: rejected %s message #%d on %s: %s", error.reason, count, origin, error.detail)

    # SGLang's common code sends terminal statuses and abort ACKs through these (sglang_compat).
    def encode_status_message(self, room: int, status: int, reason: Optional[str]) -> List[bytes]:
        # Only SGLang's deferred bootstrap (the prefill_complete allocation policy) sends statuses
        # this way, one message for every destination of the room: it can name no receiver
        # attempt, and decode counts it stale. Our own statuses go out in prefill/effects.py.
        return protocol.encode(protocol.RoomStatus(room=room, attempt=protocol.NO_ATTEMPT, status=status,
                                                   prefill_rank=self.sglang.prefill_rank, reason=reason))

    def send_abort_ack(self, room: int, ip: str, port: int, generation: Optional[int]) -> None:
        self.messenger.send((ip, port), protocol.AbortAck(room=room, prefill_rank=self.sglang.prefill_rank,
                                                          generation=generation))

    def parse_kv_status_message(self, msg):
        try:
            message = protocol.decode(msg)
        except protocol.ProtocolError:
            return None
        if not isinstance(message, protocol.RoomStatus):
            return None
        return message.room, message.status, message.prefill_rank, message.reason

    def build_receiver_registration_message(self) -> List[bytes]:
        return protocol.encode(self.service.registration())

    def build_receiver_metadata_message(self, **kwargs) -> List[bytes]:
        return protocol.encode(self.service.record_destination(**kwargs))

    def add_transfer_request(self, bootstrap_room: int, kv_indices, index_slice, is_last_chunk, **kwargs):
        if self.layerwise is not None:  # submits only what was not streamed
            self.layerwise.add_chunk(bootstrap_room, kv_indices, index_slice, is_last_chunk, **kwargs)
            return
        self.service.add_chunk(bootstrap_room, kv_indices, index_slice, is_last_chunk, **kwargs)

    # --- lifecycle and introspection -------------------------------------------------------------
    def debug_snapshot(self) -> dict:
        """Entries every per-room table of this rank still holds, by name (0 everywhere = idle)."""
        # Not len(): with prefill PP, request_status is SGLang's PPConsensusStore, which has none
        # (debug_snapshot raised TypeError on every PP prefill rank).
        out = compat.table_sizes(self)
        out.update(self.service.debug_snapshot())
        if self.transfer_process_refusal is not None:
            out["prefill.transfer_process_refused"] = 1
        if hasattr(self, "reachability"):
            out["decode.unreachable_bootstrap_addrs"] = len(self.reachability)
        return out

    def teardown(self) -> None:
        """Release what this manager holds so the scheduler can build the other role's manager in
        this process (SGLang's runtime role switch): threads first (ZMQ sockets are not
        thread-safe), then sockets, then the engine. The KV pool memory is the scheduler's."""
        compat.stop_heartbeat_checker(self)
        if self.layerwise is not None:
            self.layerwise.stop()
        self.service.stop()
        self.messenger.close()
        try:
            self.server_socket.close(linger=0)
        except Exception as exc:
            logger.warning("sglang-mori: closing the control socket failed: %s", exc)
        try:
            compat.zmq_context(self).destroy(linger=0)
        except Exception as exc:
            logger.warning("sglang-mori: destroying the ZMQ context failed: %s", exc)
        if self.engine is not None:
            self.engine.close()
        logger.info("sglang-mori %s tp%d: torn down", self.role, self.attn_tp_rank)
