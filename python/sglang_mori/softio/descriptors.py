"""EngineDesc, MemoryDesc and PeerFailureEvent: read-only value objects.

`pack()` produces the msgpack array MORI produces (the C++ struct's fields in declaration order),
so descriptors travel over the application's side channel exactly as they do with real MORI.
`unpack()` is tolerant in the same way msgpack-c's MSGPACK_DEFINE is: missing trailing fields keep
their defaults, extra trailing fields are ignored.
"""

from __future__ import annotations

import msgspec

from .enums import MemoryLocationType, PeerFailureReason

IPC_HANDLE_SIZE = 64
_EMPTY_HANDLE = bytes(IPC_HANDLE_SIZE)

_encoder = msgspec.msgpack.Encoder()
_array_decoder = msgspec.msgpack.Decoder(list)


def _decode_array(blob, what: str) -> list:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what}.unpack expects bytes, got {type(blob).__name__}")
    try:
        return _array_decoder.decode(blob)
    except msgspec.DecodeError as exc:
        raise RuntimeError(f"{what}.unpack: not a msgpack array: {exc}") from None


def _typed(value, kind, what: str, field: str):
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise RuntimeError(f"{what}.unpack: field {field} has type {type(value).__name__}")
    return value


class EngineDesc:
    """Where a peer engine can be reached; created by the engine, never by hand."""

    __slots__ = ("_key", "_node_id", "_hostname", "_host", "_port", "_pid")
    _FIELDS = (("key", str), ("node_id", str), ("hostname", str), ("host", str), ("port", int),
               ("pid", int))

    def __init__(self, key: str = "", node_id: str = "", hostname: str = "", host: str = "",
                 port: int = 0, pid: int = 0):
        self._key = key
        self._node_id = node_id
        self._hostname = hostname
        self._host = host
        self._port = port
        self._pid = pid

    key = property(lambda self: self._key)
    node_id = property(lambda self: self._node_id)
    hostname = property(lambda self: self._hostname)
    host = property(lambda self: self._host)
    port = property(lambda self: self._port)
    pid = property(lambda self: self._pid)

    def _values(self) -> tuple:
        return (self._key, self._node_id, self._hostname, self._host, self._port, self._pid)

    def pack(self) -> bytes:
        return _encoder.encode(self._values())

    @staticmethod
    def unpack(blob) -> "EngineDesc":
        items = _decode_array(blob, "EngineDesc")
        values = [_typed(v, kind, "EngineDesc", name)
                  for (name, kind), v in zip(EngineDesc._FIELDS, items)]
        return EngineDesc(*values)

    def __eq__(self, other) -> bool:
        if not isinstance(other, EngineDesc):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # like the pybind11 class: equality defined, not hashable

    def __repr__(self) -> str:
        return (f"EngineDesc(key={self._key!r}, host={self._host!r}, port={self._port}, "
                f"pid={self._pid})")


class MemoryDesc:
    """A registered memory region: remote handles are exact registrations, slices are offsets."""

    __slots__ = ("_engine_key", "_id", "_device_id", "_device_bus_id", "_data", "_size", "_loc",
                 "_ipc_handle", "_numa_node", "_ipc_offset", "_fabric_handle", "_vpod_id",
                 "_vpod_ppod_id", "_fabric_offset", "_fabric_alloc_size")
    # msgpack order of the C++ struct (engineKey, id, deviceId, deviceBusId, data, size, loc,
    # ipcHandle, numaNode, ipcOffset, fabricHandle, vpodId, vpodPpodId, fabricOffset,
    # fabricAllocSize).
    _FIELDS = (("engine_key", str), ("id", int), ("device_id", int), ("device_bus_id", str),
               ("data", int), ("size", int), ("loc", int), ("ipc_handle", bytes),
               ("numa_node", int), ("ipc_offset", int), ("fabric_handle", bytes),
               ("vpod_id", int), ("vpod_ppod_id", str), ("fabric_offset", int),
               ("fabric_alloc_size", int))

    def __init__(self):
        self._engine_key = ""
        self._id = 0
        self._device_id = -1
        self._device_bus_id = ""
        self._data = 0
        self._size = 0
        self._loc = MemoryLocationType.Unknown
        self._ipc_handle = _EMPTY_HANDLE
        self._numa_node = -1
        self._ipc_offset = 0
        self._fabric_handle = _EMPTY_HANDLE
        self._vpod_id = -1
        self._vpod_ppod_id = ""
        self._fabric_offset = 0
        self._fabric_alloc_size = 0

    @classmethod
    def _make(cls, engine_key: str, mem_id: int, device_id: int, data: int, size: int,
              loc: MemoryLocationType) -> "MemoryDesc":
        desc = cls()
        desc._engine_key = engine_key
        desc._id = mem_id
        desc._device_id = device_id
        desc._data = data
        desc._size = size
        desc._loc = MemoryLocationType(loc)
        return desc

    engine_key = property(lambda self: self._engine_key)
    id = property(lambda self: self._id)
    device_id = property(lambda self: self._device_id)
    device_bus_id = property(lambda self: self._device_bus_id)
    numa_node = property(lambda self: self._numa_node)
    data = property(lambda self: self._data)
    size = property(lambda self: self._size)
    loc = property(lambda self: self._loc)
    ipc_handle = property(lambda self: self._ipc_handle)

    def _values(self) -> tuple:
        return (self._engine_key, self._id, self._device_id, self._device_bus_id, self._data,
                self._size, int(self._loc), self._ipc_handle, self._numa_node, self._ipc_offset,
                self._fabric_handle, self._vpod_id, self._vpod_ppod_id, self._fabric_offset,
                self._fabric_alloc_size)

    def pack(self) -> bytes:
        return _encoder.encode(self._values())

    @staticmethod
    def unpack(blob) -> "MemoryDesc":
        items = _decode_array(blob, "MemoryDesc")
        desc = MemoryDesc()
        for (name, kind), value in zip(MemoryDesc._FIELDS, items):
            setattr(desc, "_" + name, _typed(value, kind, "MemoryDesc", name))
        try:
            desc._loc = MemoryLocationType(desc._loc)
        except ValueError:
            raise RuntimeError(f"MemoryDesc.unpack: unknown memory location {desc._loc}") from None
        return desc

    def __eq__(self, other) -> bool:
        if not isinstance(other, MemoryDesc):
            return NotImplemented
        # The fields MORI's operator== compares (not the handles).
        return (self._engine_key == other._engine_key and self._id == other._id
                and self._device_id == other._device_id
                and self._device_bus_id == other._device_bus_id and self._data == other._data
                and self._size == other._size and self._loc == other._loc
                and self._numa_node == other._numa_node and self._ipc_offset == other._ipc_offset)

    __hash__ = None

    def __repr__(self) -> str:
        return (f"MemoryDesc(engine_key={self._engine_key!r}, id={self._id}, "
                f"data=0x{self._data:x}, size={self._size}, loc={self._loc.name})")


class PeerFailureEvent:
    """One observed failure of the path to a peer (amd-mori 1.2.4 `PeerFailureEvent`)."""

    __slots__ = ("_remote_engine_key", "_reason", "_qp_num", "_port_num", "_device_name",
                 "_detail")

    def __init__(self, remote_engine_key: str = "",
                 reason: PeerFailureReason = PeerFailureReason.UNKNOWN, qp_num: int = 0,
                 port_num: int = 0, device_name: str = "", detail: str = ""):
        self._remote_engine_key = remote_engine_key
        self._reason = PeerFailureReason(reason)
        self._qp_num = qp_num
        self._port_num = port_num
        self._device_name = device_name
        self._detail = detail

    remote_engine_key = property(lambda self: self._remote_engine_key)
    reason = property(lambda self: self._reason)
    qp_num = property(lambda self: self._qp_num)
    port_num = property(lambda self: self._port_num)
    device_name = property(lambda self: self._device_name)
    detail = property(lambda self: self._detail)

    def __repr__(self) -> str:
        return (f"PeerFailureEvent(remote_engine_key={self._remote_engine_key!r}, "
                f"reason={self._reason.name}, qp_num={self._qp_num}, detail={self._detail!r})")
