"""softio's gather kernels byte for byte on the GPU (GPU 0 -> GPU 1 where there are two): both
kernels (`bytes`, session 22's default, `dynamic` and `ranges`), both table forms, random tables of odd
sizes, unaligned and long ranges and empty ones, at the default grid and at one block (every warp
then takes many shares or ranges), and a paged MLA shape with pages shuffled on both sides.
Every destination byte is compared, those no range covers included."""

import pytest

cupy = pytest.importorskip("cupy")

from gather_check import PagedShape, check_odd, enable_peer  # noqa: E402
from sglang_mori.softio.device_gather import GatherCopier  # noqa: E402


@pytest.fixture(scope="module")
def devices():
    src, dst = 0, (1 if cupy.cuda.runtime.getDeviceCount() > 1 else 0)
    enable_peer(cupy, src, dst)
    return src, dst


@pytest.mark.parametrize("variant", ["bytes", "dynamic", "ranges"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("one_block", [False, True])
def test_odd_tables_land_exact_bytes(devices, variant, shared, one_block):
    copier = GatherCopier(0, variant=variant)
    if one_block:
        copier.blocks = copier.peer_blocks = 1
    for seed in range(3):
        check_odd(cupy, copier, *devices, seed=seed + 10 * shared, shared=shared)


@pytest.mark.parametrize("variant", ["bytes", "dynamic"])
@pytest.mark.parametrize("unroll,threads,share", [(8, 512, 0), (16, 256, 0), (4, 1024, 16 << 10), (8, 512, 512)])
def test_bytes_kernel_settings_land_exact_bytes(devices, variant, unroll, threads, share):
    copier = GatherCopier(0, variant=variant, unroll=unroll, threads=threads, share=share)
    check_odd(cupy, copier, *devices, seed=unroll + threads, shared=True, pairs=5, count=60)
    check_odd(cupy, copier, *devices, seed=unroll + threads + 1, shared=False, pairs=2, count=60)


@pytest.mark.parametrize("variant", ["bytes", "dynamic", "ranges"])
def test_a_paged_mla_request_lands_exact_bytes(devices, variant):
    shape = PagedShape(cupy, "mla p64 2048", 61, 32, 73728, *devices, seed=3)
    try:
        shape.check(GatherCopier(0, variant=variant))
    finally:
        shape.free()
