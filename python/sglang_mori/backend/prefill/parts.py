"""What a prefill service is built from. Tests build one from softio and fakes, no manager."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from sglang_mori.backend.messenger import Messenger
from sglang_mori.backend.peers import PeerRegistry
from sglang_mori.backend.plans import KVPlanner, LocalBuffers
from sglang_mori.backend.prefill.context_parallel import PrefillCP
from sglang_mori.backend.prefill.rooms import PrefillRoomRegistry
from sglang_mori.config import MoriConfig


@dataclass
class PrefillParts:
    config: MoriConfig
    engine: object  # engine.TransferEngine
    local: LocalBuffers
    planner: KVPlanner
    peers: PeerRegistry  # with its in-flight budget
    messenger: Messenger
    metrics: object  # metrics.TransferMetrics or NullTransferMetrics
    sglang: object  # sglang_adapter.SGLangAdapter (or a test fake with the same methods)
    # aux_index -> this room's aux items, one bytes per aux buffer (they ride on Success)
    read_aux: Callable[[Optional[int]], Optional[list]]
    control_socket: object = None  # the manager's PULL socket (decode -> prefill messages)
    dcp: tuple = (1, 0)  # this rank's (decode context parallel size, rank): (1, 0) on prefill
    # Whether this rank's aux (metadata: output ids, logprobs, EAGLE/MTP hidden states and top-k)
    # is the request's: only the last pipeline stage computes it, and context-parallel ranks hold
    # the same copy. The others send Success without aux, so a stale buffer never lands.
    owns_aux: bool = True
    # This rank's place in prefill context parallelism / KV sharding: decode peers that expect
    # Successes from other CP ranks than the ones that send are refused at registration.
    cp: PrefillCP = field(default_factory=PrefillCP)
    rooms: PrefillRoomRegistry = field(default_factory=PrefillRoomRegistry)
    clock: Callable[[], float] = time.monotonic
    # Chunks are handed over on SGLang's scheduler thread (False: the transfer process's reader
    # thread, ours): SGLANG_MORI_INLINE_POST=auto posts inline only where this is False.
    scheduler_hands_over: bool = True

    def __post_init__(self):
        # One clock for the whole service: deadlines, peers' fail-fast windows, the in-flight
        # budget's waits and the engine's handles are all compared with each other.
        self.peers.use_clock(self.clock)
        self.engine.use_clock(self.clock)

    @property
    def timeout_s(self) -> float:
        return self.config.transfer_timeout_ms / 1000.0
