"""The transfer process's service: the engine, the imported pools, today's PrefillService, and the
loop that turns hand-off records into the calls SGLang's scheduler makes in-process."""

from __future__ import annotations

import logging
import os

import zmq

from sglang_mori.backend.messenger import Messenger
from sglang_mori.backend.peers import InflightBudget, PeerRegistry
from sglang_mori.backend.plans import KVPlanner, LocalBuffers, decode_layout
from sglang_mori.backend.failure_reasons import ALL as FAILURE_REASONS
from sglang_mori.backend.prefill.failures import OTHER
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.service import PrefillService
from sglang_mori.engine import TransferEngine, load_io_module
from sglang_mori.metrics import NullTransferMetrics
from sglang_mori.transfer_process import cpu_report, handoff, proof
from sglang_mori.transfer_process.child import AuxStore, ChildSpec
from sglang_mori.transfer_process.child_tables import ChildTables
from sglang_mori.transfer_process.pools import ImportedPools
from sglang_mori.transfer_process.proof import RegistrationNotProven
from sglang_mori.transfer_process.status_table import StatusTable

logger = logging.getLogger(__name__)


class StartupFailed(RuntimeError):
    """The child could not start; the reason is in the status table for the scheduler."""


class ChildService:
    def __init__(self, spec: ChildSpec):
        self.table = StatusTable.attach(spec.table_name, spec.table_slots)
        self.pools = self.engine = None
        try:
            self._build(spec)
        except Exception as exc:  # a crash instead (e.g. in the GPU runtime) shows as the exit code
            reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RegistrationNotProven) else str(exc)
            self.table.publish_startup_failure(reason)
            for part in (self.engine, self.pools):
                try:
                    if part is not None:
                        part.close()
                except Exception:  # best effort: the process ends next
                    pass
            raise StartupFailed(reason) from exc
        self.startup_cpu_s = cpu_report.process_cpu_s("self")
        self.ready_threads = cpu_report.threads_cpu_s()
        self.table.publish_port(self.port)
        logger.info("sglang-mori transfer process pid %d: engine %s on %s, control port %d, %d KV buffers "
                    "registered and proven; start-up used %.0f ms of CPU", os.getpid(), spec.config.engine,
                    spec.host, self.port, len(spec.kv), self.startup_cpu_s * 1e3)

    def _build(self, spec: ChildSpec) -> None:
        cfg = spec.config
        self.pools = ImportedPools(spec.kv)

        def make_engine(role="prefill"):
            return TransferEngine(
                load_io_module(cfg.engine), role=role, host=spec.host, qp_per_transfer=cfg.qp_per_transfer,
                post_batch_size=cfg.post_batch_size, num_workers=cfg.num_workers,
                enable_notification=cfg.enable_notification,
            )

        self.engine = make_engine()
        buffers = LocalBuffers(
            kv=[self.engine.register(ptr, p.size, spec.device, spec.on_gpu) for ptr, p in zip(self.pools.ptrs, spec.kv)],
            aux=[],  # aux bytes ride on the last chunk's record, then on Success
            state=[],
        )
        # Before any traffic: the engine posts from every imported pool (proof.py says why).
        proof.prove(self.engine, lambda: make_engine("prefill-proof"), buffers.kv, self.pools.ptrs,
                    [p.size for p in spec.kv], spec.on_gpu, spec.device,
                    self.pools.runtime if spec.on_gpu else None)
        self.zmq = zmq.Context()
        self.control = self.zmq.socket(zmq.PULL)
        self.port = self.control.bind_to_random_port(f"tcp://{spec.control_host}")
        self.messenger = Messenger(self.zmq)
        self.tables = ChildTables(self.table, self.messenger, spec.prefill_rank, spec.aux_buffers,
                                  spec.deferred_release, spec.bootstrap_timeout_s, spec.decode_release_timeout_s)
        self.aux = AuxStore()
        parts = PrefillParts(
            config=cfg, engine=self.engine, local=buffers, planner=KVPlanner(decode_layout(spec.layout), buffers),
            peers=PeerRegistry(cfg.peer_fail_fast_s, InflightBudget.from_config(cfg)),
            messenger=self.messenger, metrics=NullTransferMetrics(), sglang=self.tables,
            read_aux=self.aux.items.get, control_socket=self.control, owns_aux=spec.owns_aux,
            scheduler_hands_over=False,  # this process's reader thread calls add_chunk
        )
        self.service = PrefillService(parts, self._reject)
        self.service.start()

    @staticmethod
    def _reject(error, origin: str) -> None:
        logger.warning("sglang-mori: rejected %s message on %s: %s", error.reason, origin, error.detail)

    def serve(self, channel) -> None:
        records = handoff.Receiver(channel)
        while True:
            try:
                rec = records.next()
            except OSError:
                return
            if rec is None:  # the scheduler closed its end (teardown, or it died)
                return
            try:
                self.handle(rec)
            except Exception:  # one bad record fails nothing else
                logger.exception("sglang-mori: transfer process: record %d of room %s failed", rec.kind, rec.room)

    def handle(self, rec: handoff.Record) -> None:
        svc, room = self.service, rec.room
        if rec.kind == handoff.CHUNK:
            token = self.aux.put(room, rec.aux) if rec.aux is not None else rec.aux_index
            svc.add_chunk(room, rec.pages, slice(rec.start, rec.stop), rec.is_last, aux_index=token,
                          num_kv_tokens=rec.num_kv_tokens)
        elif rec.kind == handoff.CLAIM:
            self.tables.open(room, rec.slot)
            reason = svc.claim(room)
            if reason is not None:
                self.tables.fail(room, reason)
        elif rec.kind == handoff.RELEASE:
            svc.release(room)
            self.tables.close(room, rec.slot)
            self.aux.drop_room(room)
        elif rec.kind == handoff.FAIL:
            # the scheduler's label, kept only if it is one of ours (metrics count the rest as other)
            label = rec.label if rec.label in FAILURE_REASONS else OTHER
            svc.fail(room, rec.reason, label)

    def close(self) -> None:
        used = cpu_report.since(self.ready_threads, cpu_report.threads_cpu_s())
        logger.info("sglang-mori transfer process pid %d: CPU since ready, by thread: %s", os.getpid(),
                    cpu_report.describe(used))
        self.service.stop()
        self.messenger.close()
        self.control.close(linger=0)
        self.zmq.destroy(linger=0)
        self.engine.close()
        self.pools.close()
        self.table.close()
