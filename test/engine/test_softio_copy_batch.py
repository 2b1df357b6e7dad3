"""softio's cudaMemcpyBatchAsync call (cuda_runtime.CudaRuntime.copy), on a CPU stand-in of the
runtime that reads the call's arguments as the CUDA runtime does and moves the bytes: every
range lands, each call names its own device in its attributes and its own stream, for CUDA 12
(with failIdx) and 13 (without), also when the per-device attributes are reused (issue 28)."""

import ctypes

import numpy as np
import pytest

from sglang_mori.softio import cuda_runtime


class BatchLib:
    """cudaMemcpyBatchAsync, read like the runtime: the three pointer arrays, the count, the
    attributes by reference, one attribute index array, then the stream."""

    def __init__(self, version: int):
        self.version = version
        self.calls = []
        self.devices = []
        self.cudaGetErrorString = lambda rc: b"fake CUDA error"
        self.cudaMemcpyBatchAsync = self._batch

    def cudaRuntimeGetVersion(self, out):
        out._obj.value = self.version
        return 0

    def cudaSetDevice(self, device):
        self.devices.append(device.value)
        return 0

    def _batch(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, *rest):
        n = count.value
        read = lambda p: np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint64)), (n,)).copy()
        d, s, z = read(dsts), read(srcs), read(sizes)
        a = attrs._obj
        idx = attr_idxs._obj.value
        if self.version < 13000:
            fail_idx, stream = rest
            assert isinstance(fail_idx._obj, ctypes.c_size_t)
        else:
            (stream,) = rest
        for dst, src, size in zip(d, s, z):
            ctypes.memmove(int(dst), int(src), int(size))
        self.calls.append(dict(n=n, src_device=a.srcLocHint.id, dst_device=a.dstLocHint.id, order=a.srcAccessOrder,
                               flags=a.flags, idx=idx, num_attrs=num_attrs.value, stream=stream.value))
        return 0


@pytest.mark.parametrize("version", [12080, 13000])
def test_every_range_lands_and_each_call_names_its_device_and_stream(version):
    lib = BatchLib(version)
    rt = cuda_runtime.CudaRuntime(lib)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    for round_, (device, stream) in enumerate([(0, 0x10), (0, 0x10), (1, 0x20), (0, 0x30)]):
        dst[:] = 0
        offsets = np.array([0, 1000, 3000], dtype=np.uint64) + round_
        sizes = np.array([100, 7, 1000], dtype=np.uint64)
        rt.copy(dst.ctypes.data + offsets[::-1].copy(), src.ctypes.data + offsets, sizes, stream, device)
        for off, back, size in zip(offsets.tolist(), offsets[::-1].tolist(), sizes.tolist()):
            assert dst[back:back + size].tolist() == src[off:off + size].tolist()
    assert rt.batch_calls  # never fell back to range-by-range copies
    assert [(c["src_device"], c["dst_device"], c["stream"]) for c in lib.calls] == [
        (0, 0, 0x10), (0, 0, 0x10), (1, 1, 0x20), (0, 0, 0x30)]
    assert all(c["n"] == 3 and c["idx"] == 0 and c["num_attrs"] == 1 and c["order"] == 1 and c["flags"] == 1
               for c in lib.calls)
