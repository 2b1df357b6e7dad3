"""Fixtures of the engine conformance suite.

Tests that take `engine_kind` run once per available engine: softio always, on each of its two
paths ("softio-tcp": TCP lanes; "softio-intrahost": cross-memory attach between processes of one
host), and real `mori.io` only when SGLANG_MORI_MANUAL_E2E=1 and it imports (otherwise that
parameter is simply not generated). Tests of softio-only features (fault injection, write log,
wire robustness) run on both softio paths and say so in their names.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

from engine_peer import (SOFTIO_KINDS, EnginePeer, check_paths, engine_env, engine_module,
                         unique_key)


def _available_kinds() -> list[str]:
    kinds = list(SOFTIO_KINDS)
    if os.environ.get("SGLANG_MORI_MANUAL_E2E") == "1":
        try:
            importlib.import_module("mori.io")
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            pass
        else:
            kinds.append("mori")
    return kinds


ENGINE_KINDS = _available_kinds()


def pytest_generate_tests(metafunc):
    if "engine_kind" in metafunc.fixturenames:
        # Modules about softio's own features (faults, write log, wire) set SOFTIO_ONLY.
        kinds = SOFTIO_KINDS if getattr(metafunc.module, "SOFTIO_ONLY", False) else ENGINE_KINDS
        kinds = getattr(metafunc.module, "KINDS", kinds)  # a module about one softio path
        metafunc.parametrize("engine_kind", kinds, scope="module")


class Initiator:
    """An engine in the test process, plus helpers to make local buffers and reach a peer."""

    def __init__(self, io, kind: str, qp: int = 2, notify: bool = False,
                 post_batch_size: int = -1):
        self.io = io
        self.kind = kind
        self.key = unique_key("initiator")
        self.engine = io.IOEngine(self.key, io.IOEngineConfig("127.0.0.1", 0))
        with engine_env(kind):
            self.engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig(
                qp, post_batch_size, -1, io.PollCqMode.POLLING, notify))
        self._keep = []

    def local(self, size: int, seed: int = 1) -> tuple[np.ndarray, object]:
        """A registered local buffer filled with reproducible random bytes."""
        array = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        self._keep.append(array)
        mem = self.engine.register_memory(array.ctypes.data, size, -1,
                                          self.io.MemoryLocationType.CPU)
        return array, mem

    def connect(self, peer: EnginePeer) -> None:
        self.engine.register_remote_engine(self.io.EngineDesc.unpack(peer.desc_blob))

    def remote(self, peer: EnginePeer, size: int, fill: int = 0):
        """A region registered in the peer: (shared view of its bytes, unpacked MemoryDesc)."""
        buf, blob = peer.register(size, fill)
        return buf.array, self.io.MemoryDesc.unpack(blob)

    def close(self) -> None:
        check_paths(self.engine, self.kind)
        self.engine.remove_backend(self.io.BackendType.RDMA)
        self.engine = None


@pytest.fixture(scope="module")
def io(engine_kind):
    return engine_module(engine_kind)


@pytest.fixture(scope="module")
def shared_peer(engine_kind):
    """A target peer shared by the tests of a module that leave it healthy."""
    peer = EnginePeer(engine_kind, qp=2, role="shared-target")
    yield peer
    peer.close()


@pytest.fixture
def make_peer(engine_kind):
    peers = []

    def make(**kwargs) -> EnginePeer:
        peer = EnginePeer(engine_kind, **kwargs)
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        peer.close()


@pytest.fixture
def make_initiator(io, engine_kind):
    made = []

    def make(**kwargs) -> Initiator:
        initiator = Initiator(io, engine_kind, **kwargs)
        made.append(initiator)
        return initiator

    yield make
    for initiator in made:
        initiator.close()


@pytest.fixture
def initiator(make_initiator, shared_peer):
    """An initiator already registered with the shared peer."""
    ini = make_initiator()
    ini.connect(shared_peer)
    return ini
