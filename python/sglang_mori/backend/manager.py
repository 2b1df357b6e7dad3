"""MoriKVManager: one per scheduler process and role; owns the IOEngine and the registered buffers.

SGLang's CommonKVManager provides bootstrap registration, the parallel-info handshake, room states,
heartbeats and abort bookkeeping. This class adds the MORI-IO engine, our typed protocol on the
manager's ZMQ socket, and the role-specific services (prefill: transfer workers and completion
tracking; decode: status handling and deadlines).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import List, Optional, Tuple

import zmq
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_mori import protocol
from sglang_mori.backend.plans import KVPlanner, local_layout
from sglang_mori.config import MoriConfig, mori_env_overrides
from sglang_mori.engine import TransferEngine, load_io_module
from sglang_mori.metrics import create_transfer_metrics

logger = logging.getLogger(__name__)


class MoriKVManager(CommonKVManager):
    # Decode holds aborted pages until our ACK says every write into them is terminal.
    supports_deferred_decode_kv_release = True
    reports_transfer_latency = True
    kv_status_msg_carries_reason = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args,
        is_mla_backend: Optional[bool] = False,
    ):
        # Validate our configuration before anything binds a socket or registers with bootstrap.
        self.mori_config = MoriConfig.from_env()
        for warning in mori_env_overrides(self.mori_config, os.environ):
            logger.warning("sglang-mori: %s", warning)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.protocol_rejections: Counter = Counter()
        # Decode: bootstrap addresses whose parallel info could not be fetched yet (addr -> first
        # failed attempt, failed attempts), for the reason of the rooms SGLang aborts over it.
        self.bootstrap_unreachable: dict = {}
        self._push_sockets = threading.local()
        self.metrics = create_transfer_metrics(
            bool(getattr(server_args, "enable_metrics", False)),
            engine_type=disaggregation_mode.value,
            tp_rank=self.attn_tp_rank,
            pp_rank=self.pp_rank or 0,
            dp_rank=self.system_dp_rank or 0,
        )
        self._stopped = False
        self.layout = local_layout(self)
        self.engine = self._start_engine()
        self._register_buffers()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            from sglang_mori.backend.prefill_service import PrefillService

            self.planner = KVPlanner(self)
            self.service = PrefillService(self)
        else:
            from sglang_mori.backend.decode_service import DecodeService

            self.service = DecodeService(self)
            self._heartbeat_thread = self._start_heartbeat_checker_thread()
        self.service.start()
        if self.mori_config.gc_freeze:
            from sglang_mori.gc_tuning import freeze_startup_heap

            freeze_startup_heap(f"{disaggregation_mode.value} tp{self.attn_tp_rank}")

    # --- engine and registration --------------------------------------------------------
    def _start_engine(self) -> TransferEngine:
        cfg = self.mori_config
        if self.kv_args.ib_device:
            # MORI-IO picks RDMA devices from this variable. --disaggregation-ib-device is either a
            # device list or a per-GPU mapping (JSON or a file): resolve it for this rank's GPU.
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                get_ib_devices_for_gpu,
            )

            devices = get_ib_devices_for_gpu(self.kv_args.ib_device, self.kv_args.gpu_id)
            if devices:
                os.environ["MORI_RDMA_DEVICES"] = devices.replace(" ", "")
        if cfg.xgmi:
            os.environ["MORI_DISABLE_AUTO_XGMI"] = "0"  # inverted: only "0" enables auto-XGMI
        io = load_io_module(cfg.engine)
        host = cfg.host or self.local_ip
        engine = TransferEngine(
            io,
            role=self.disaggregation_mode.value,
            host=host,
            qp_per_transfer=cfg.qp_per_transfer,
            post_batch_size=cfg.post_batch_size,
            num_workers=cfg.num_workers,
            enable_notification=cfg.enable_notification,
        )
        logger.info(
            "sglang-mori %s tp%d: engine=%s (%s) host=%s port=%s zmq_port=%s nic=%s qp=%d "
            "workers=%d shards=%d timeout_ms=%d",
            self.disaggregation_mode.value,
            self.attn_tp_rank,
            cfg.engine,
            io.__name__,
            engine.desc.host,
            engine.desc.port,
            self.rank_port,
            os.environ.get("MORI_RDMA_DEVICES", "auto"),
            cfg.qp_per_transfer,
            cfg.num_workers,
            cfg.transfer_shards,
            cfg.transfer_timeout_ms,
        )
        return engine

    def _register_buffers(self) -> None:
        args = self.kv_args
        on_gpu = self._kv_on_gpu()
        device = args.gpu_id if on_gpu else -1
        self.kv_descs = [
            self.engine.register(ptr, size, device, on_gpu)
            for ptr, size in zip(args.kv_data_ptrs, args.kv_data_lens)
        ]
        # SGLang keeps aux (metadata) buffers in host memory.
        self.aux_descs = [
            self.engine.register(ptr, size, -1, False)
            for ptr, size in zip(args.aux_data_ptrs, args.aux_data_lens)
        ]
        # Zero-length state buffers stay as None so indices keep lining up.
        self.state_descs = [
            [self.engine.register(ptr, size, device, on_gpu) for ptr, size in zip(ptrs, lens)]
            for ptrs, lens in zip(args.state_data_ptrs or [], args.state_data_lens or [])
        ]

    def _kv_on_gpu(self) -> bool:
        try:
            from sglang.srt.runtime_context import get_device

            return get_device().device not in ("cpu",)
        except Exception:
            return True

    # --- bootstrap reachability (decode) ------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's single attempt, remembering failures per address.

        When the bootstrap server cannot be reached, SGLang's decode scheduler retries this (15
        attempts, 1 s apart) and then calls `abort()` on every request waiting on the address,
        which would record only "Aborted by AbortReq.". MoriKVReceiver.abort() uses what is kept
        here to say instead that the bootstrap server was unreachable, for how long."""
        ok = super().try_ensure_parallel_info(bootstrap_addr)
        if ok:
            self.bootstrap_unreachable.pop(bootstrap_addr, None)
        else:
            first, attempts = self.bootstrap_unreachable.get(bootstrap_addr, (time.monotonic(), 0))
            if bootstrap_addr not in self.bootstrap_unreachable and len(self.bootstrap_unreachable) >= 1024:
                self.bootstrap_unreachable.pop(next(iter(self.bootstrap_unreachable)))  # bounded
            self.bootstrap_unreachable[bootstrap_addr] = (first, attempts + 1)
        return ok

    def bootstrap_unreachable_reason(self, bootstrap_addr: str) -> Optional[str]:
        """Why rooms on `bootstrap_addr` never got past the parallel-info fetch, or None."""
        if bootstrap_addr in self.prefill_info_table:
            return None
        entry = self.bootstrap_unreachable.get(bootstrap_addr)
        if entry is None:
            return None
        first, attempts = entry
        return (f"bootstrap server {bootstrap_addr} unreachable: {attempts} attempts over "
                f"{time.monotonic() - first:.1f} s could not fetch the prefill server's parallel info")

    def forget_bootstrap_failures(self, bootstrap_addr: str) -> None:
        """No room waits on `bootstrap_addr` any more: drop its failure count."""
        if not self.addr_to_rooms_tracker.get(bootstrap_addr):
            self.bootstrap_unreachable.pop(bootstrap_addr, None)

    # --- messaging ----------------------------------------------------------------------
    def send_message(self, endpoint: Tuple[str, int], message) -> bool:
        """Push one protocol message; False (logged) when the peer cannot be reached."""
        ip, port = endpoint
        try:
            self._thread_socket(f"tcp://{ip}:{port}").send_multipart(protocol.encode(message))
            return True
        except Exception as exc:
            logger.warning("sglang-mori: cannot send %s to %s:%s: %s", type(message).__name__, ip, port, exc)
            return False

    def _thread_socket(self, endpoint: str):
        """A PUSH socket owned by the calling thread.

        SGLang's shared socket cache serialises every send of every thread on one lock and polls a
        monitor socket per send; with a message per chunk that lock was the hottest spot on the
        prefill side. ZMQ sockets are single-threaded anyway. Messages of one thread to one peer
        stay ordered, and a room's data-bearing message (RoomStatus with aux) is a single message.
        """
        cache = getattr(self._push_sockets, "cache", None)
        if cache is None:
            cache = self._push_sockets.cache = {}
        sock = cache.get(endpoint)
        if sock is None:
            sock = self._zmq_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            # A dead peer must not block a transfer thread for long: bounded send, then give up.
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            sock.connect(endpoint)
            cache[endpoint] = sock
        return sock

    def reject_message(self, error: protocol.ProtocolError, origin: str) -> None:
        """Count every rejection; log the first of each kind loudly, then every 100th."""
        self.protocol_rejections[error.reason] += 1
        self.metrics.failure("protocol")
        count = self.protocol_rejections[error.reason]
        if count == 1 or count % 100 == 0:
            logger.warning(
                "sglang-mori: rejected %s message #%d on %s: %s", error.reason, count, origin, error.detail
            )

    # SGLang's common code sends terminal statuses through these two; speak our protocol there.
    def _encode_kv_status_message(self, *, bootstrap_room, status, failure_reason) -> List[bytes]:
        return protocol.encode(
            protocol.RoomStatus(
                room=int(bootstrap_room),
                status=int(status),
                prefill_rank=self._prefill_unique_rank(),
                reason=failure_reason,
            )
        )

    def parse_kv_status_message(self, msg):
        try:
            message = protocol.decode(msg)
        except protocol.ProtocolError:
            return None
        if not isinstance(message, protocol.RoomStatus):
            return None
        return message.room, message.status, message.prefill_rank, message.reason

    def _send_abort_ack(self, room: int, target) -> None:
        self.send_message(
            (target.ip, target.port),
            protocol.AbortAck(
                room=int(room), prefill_rank=self._prefill_unique_rank(), generation=target.generation
            ),
        )

    def build_receiver_registration_message(self) -> List[bytes]:
        return self.service.registration_message()

    def build_receiver_metadata_message(self, **kwargs) -> List[bytes]:
        return self.service.metadata_message(**kwargs)

    def add_transfer_request(self, bootstrap_room: int, kv_indices, index_slice, is_last_chunk, **kwargs):
        self.service.add_transfer_request(bootstrap_room, kv_indices, index_slice, is_last_chunk, **kwargs)

    def fail_room(self, room: int, reason: str, label: str = "other", before_sender: bool = False) -> None:
        """Fail one room with a reason: record it, mark it Failed, tell its decode endpoints.

        A room this rank does not hold is left alone: it was concluded and cleared already (a
        record now would never be popped, and a later request reusing the id would adopt it).
        Only `before_sender` callers -- decode's messages, which may arrive before the request's
        sender exists here -- record the reason for the sender to find."""
        if room not in self.request_status:
            if before_sender:
                self.record_failure(room, reason)
            return
        logger.warning("sglang-mori: room %s failed: %s", room, reason)
        self.metrics.failure(label)
        self.metrics.request_finished(ok=False)
        self.conclude_failure(bootstrap_room=room, failure_reason=reason)

    # --- lifecycle ----------------------------------------------------------------------
    def teardown(self) -> None:
        self._stopped = True
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        self.service.stop()
        self.engine.deregister_all()
