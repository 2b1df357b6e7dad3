"""A fake `io` module with mori.io's API for TransferEngine's unit tests, and a virtual clock
(shared by test_engine_wrapper.py and test_engine_wrapper_spare_uids.py)."""

import enum
import types

import pytest

from sglang_mori.engine import transfer_engine as te
from sglang_mori.engine.transfer_engine import ERR_RDMA_OP, SUCCESS, TransferEngine, WritePair

SQ_FULL = "post send failed: SQ full"


# --- a fake mori.io ---------------------------------------------------------------------------

class Status:
    def __init__(self, code, message=""):
        self.code, self.message = code, message

    def Code(self):
        return self.code

    def Message(self):
        return self.message

    def Failed(self):
        return self.code > 10

    def __repr__(self):
        return f"Status({self.code}, {self.message!r})"


def ok():
    return Status(SUCCESS)


def sq_full():
    return Status(ERR_RDMA_OP, SQ_FULL)


class EngineDesc:
    def __init__(self, key, port):
        self.key, self.port = key, port

    def pack(self):
        return f"{self.key}|{self.port}".encode()

    @staticmethod
    def unpack(blob):
        key, port = blob.decode().split("|")
        return EngineDesc(key, int(port))

    __hash__ = None  # like pybind11's EngineDesc


class MemoryDesc:
    def __init__(self, ptr, size, loc):
        self.ptr, self.size, self.loc = ptr, size, loc

    @staticmethod
    def unpack(blob):
        ptr, size = blob.split(b":")
        return MemoryDesc(int(ptr), int(size), None)


class IOEngine:
    def __init__(self, key, config):
        self.key, self.config = key, config
        self.backends = []
        self.registered = []
        self.deregistered = []
        self.remotes = []
        self.remotes_removed = []
        self.sessions = []
        self.next_uid = 0
        self.calls = []  # batch_write arguments, one tuple per call
        # One entry per batch_write call: a list of statuses, or an exception to raise.
        self.script = []
        self.waited = []
        self.fail_deregister = False

    def create_backend(self, kind, config):
        self.backends.append((kind, config))

    def get_engine_desc(self):
        return EngineDesc(self.key, 40000 + len(self.backends))

    def register_memory(self, ptr, size, device_id, loc):
        desc = MemoryDesc(ptr, size, loc)
        self.registered.append((ptr, size, device_id, loc))
        return desc

    def deregister_memory(self, desc):
        if self.fail_deregister:
            raise RuntimeError("deregister failed")
        self.deregistered.append(desc)

    def register_remote_engine(self, desc):
        self.remotes.append(desc.key)

    def deregister_remote_engine(self, desc):
        self.remotes_removed.append(desc.key)

    def create_session(self, local, remote):
        self.sessions.append((local, remote))

    def allocate_transfer_uid(self):
        self.next_uid += 1
        return self.next_uid

    def batch_write(self, locals_, local_offsets, remotes, remote_offsets, sizes, uids):
        self.calls.append((locals_, local_offsets, remotes, remote_offsets, sizes, uids))
        outcome = self.script.pop(0) if self.script else [ok() for _ in locals_]
        if isinstance(outcome, BaseException):
            raise outcome
        assert len(outcome) == len(locals_), "test script gives one status per pair"
        return outcome

    def wait_all(self, statuses, timeout_ms):
        self.waited.append((list(statuses), timeout_ms))
        return SUCCESS


class EngineWithFailureEvents(IOEngine):
    def __init__(self, key, config):
        super().__init__(key, config)
        self.failure_events = []

    def pop_peer_failure(self):
        return self.failure_events.pop(0) if self.failure_events else None


def fake_io(engine_cls=IOEngine):
    return types.SimpleNamespace(
        IOEngine=engine_cls,
        IOEngineConfig=lambda host, port: ("IOEngineConfig", host, port),
        RdmaBackendConfig=lambda *args: ("RdmaBackendConfig",) + args,
        PollCqMode=enum.Enum("PollCqMode", "POLLING EVENT"),
        BackendType=enum.Enum("BackendType", "XGMI RDMA TCP"),
        MemoryLocationType=enum.Enum("MemoryLocationType", "CPU GPU"),
        EngineDesc=EngineDesc,
        MemoryDesc=MemoryDesc,
    )


def make_engine(io=None, **kw):
    args = dict(role="prefill", host="127.0.0.1", qp_per_transfer=4, post_batch_size=-1,
                num_workers=2)
    args.update(kw)
    return TransferEngine(io or fake_io(), **args)


def pair(i):
    return WritePair(local=f"L{i}", remote=f"R{i}", local_offsets=[i * 100, i * 100 + 10],
                     remote_offsets=[i * 200, i * 200 + 20], sizes=[8, i + 1])


class FakeTime:
    """Replaces `time` inside transfer_engine: sleep advances a virtual clock, never blocks."""

    def __init__(self, now=1000.0):
        self.now = now
        self.sleeps = []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = FakeTime()
    monkeypatch.setattr(te, "time", c)
    return c
