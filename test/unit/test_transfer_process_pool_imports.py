"""How the transfer process maps SGLang 0.5.23's GPU KV pools (transfer_process/pools.py), with fake
runtimes: SGLang's MHA pool allocates each layer's K and V as the two halves of one tensor, and the
caching allocator places tensors inside larger segments, so a pool's pointer is an IPC handle of its
allocation plus an offset, and pools of one allocation share one mapping in the child."""

from sglang_mori.softio import cuda_runtime
from sglang_mori.transfer_process import device_runtime, pools

MB = 1 << 20
# Two caching-allocator segments; a layer's fused (2, rows, heads, dim) tensor starts 4 MB into the
# first one (after another tensor); V is its second half.
SEGMENTS = {0x7000_0000_0000: 64 * MB, 0x7100_0000_0000: 64 * MB}
K0 = 0x7000_0000_0000 + 4 * MB
V0 = K0 + 8 * MB
K1 = 0x7100_0000_0000


class FakeExporter:
    """export(ptr) as a runtime does it: the allocation holding ptr, a fresh handle object each call."""

    def __init__(self):
        self.exports = 0

    def export(self, ptr, device):
        base = next(b for b, size in SEGMENTS.items() if b <= ptr < b + size)
        self.exports += 1
        return bytearray(base.to_bytes(8, "little") + bytes(56)), ptr - base


def test_pools_inside_one_allocation_share_its_handle_at_their_offsets(monkeypatch):
    exporter = FakeExporter()
    monkeypatch.setattr(cuda_runtime, "load", lambda: exporter)
    got = pools.describe([K0, V0, K1], [8 * MB, 8 * MB, 8 * MB], True, 0)
    assert [(p.kind, p.offset, p.size, p.device) for p in got] == [
        ("cuda", 4 * MB, 8 * MB, 0), ("cuda", 12 * MB, 8 * MB, 0), ("cuda", 0, 8 * MB, 0)]
    assert got[0].handle is got[1].handle  # the very bytes: the child maps the allocation once
    assert got[0].handle != got[2].handle


class FakeOpener:
    """The child's side: a handle maps at its own base (never the exporter's address)."""

    def __init__(self):
        self.opened, self.closed, self.imported_ranges = [], [], []

    def note_imported(self, ptr, size):
        self.imported_ranges.append((ptr, size))

    def open(self, handle, device):
        self.opened.append((bytes(handle), device))
        return 0x5000_0000_0000 + int.from_bytes(bytes(handle)[:8], "little") % (1 << 40)

    def close(self, handle_or_base, device):
        self.closed.append((handle_or_base, device))


def imports():
    exporter = FakeExporter()
    out = []
    for ptr in (K0, V0, K1):
        handle, offset = exporter.export(ptr, 0)
        out.append((handle, offset))
    return out


def test_cuda_imports_point_at_the_pool_not_the_segment_base(monkeypatch):
    opener = FakeOpener()
    monkeypatch.setattr(cuda_runtime, "load", lambda: opener)
    monkeypatch.setattr(device_runtime, "load", lambda: object())
    descs = [pools.PoolImport("cuda", 8 * MB, handle=bytes(h), offset=o, device=0) for h, o in imports()]
    mapped = pools.ImportedPools(descs)
    base0 = opener.open(descs[0].handle, 0)
    assert mapped.ptrs[0] == base0 + 4 * MB and mapped.ptrs[1] == base0 + 12 * MB
    assert mapped.ptrs[2] == opener.open(descs[2].handle, 0)
    # each pool, where the child sees it, is noted as imported (softio registers it without a handle)
    assert opener.imported_ranges == [(ptr, 8 * MB) for ptr in mapped.ptrs]
    mapped.close()
    # softio's runtime counts one hold per open() and unmaps at the last close()
    assert len(opener.closed) == 3


def test_hip_maps_an_allocation_once_for_all_its_pools_and_unmaps_it_once(monkeypatch):
    opener = FakeOpener()
    monkeypatch.setattr(device_runtime, "load", lambda: opener)
    descs = [pools.PoolImport("hip", 8 * MB, handle=bytes(h), offset=o, device=2) for h, o in imports()]
    mapped = pools.ImportedPools(descs)
    assert len(opener.opened) == 2  # K0 and V0's allocation once, K1's once
    base0 = 0x5000_0000_0000 + (0x7000_0000_0000 % (1 << 40))
    assert mapped.ptrs == [base0 + 4 * MB, base0 + 12 * MB, opener.open(descs[2].handle, 2)]
    mapped.close()
    assert sorted(opener.closed) == sorted([(base0, 2), (mapped.ptrs[2], 2)])
