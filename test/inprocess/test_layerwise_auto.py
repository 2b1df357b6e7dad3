"""SGLANG_MORI_LAYERWISE=auto serves every deployment `off` serves (issue 26): a decode the layer
streams cannot pair page for page (decode context parallel) registers, its rooms fall back
chunk-wise with a counted reason, and their bytes land exactly where `off` puts them.

The start-up refusals of `on` (deployments that cannot stream) are checked the same way in
test/unit/test_layerwise_assembly.py; this module covers the refusal at registration.
"""

import msgspec
import numpy as np

from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.layerwise.assembly import layerwise_planner
from sglang_mori.backend.prefill.layerwise.session import BatchView, ReqView

from layerwise_rig import CountingMetrics
from rig import PrefillRig

MLA = dict(is_mla=True, kv_physical_layout=None)


def test_auto_serves_a_decode_context_parallel_decode_chunk_wise_byte_exact():
    """As test_prefill_service's DCP relayout test, with the prefill built for `auto` and a
    layer-wise session running: the decode's registration is accepted, the batch that would stream
    the room falls back (`decode_context_parallel`), and the relayout lands byte-exact."""
    with PrefillRig() as rig:
        layout = msgspec.structs.replace(rig.prefill.layout, **MLA)
        rig.parts.planner = layerwise_planner("auto", layout, rig.prefill.buffers)
        rig.metrics = rig.parts.metrics = CountingMetrics()
        session = rig.layerwise()
        rig.decode_service.p.layout = msgspec.structs.replace(rig.decode.layout, dcp_size=2, dcp_rank=1, **MLA)
        rig.decode_service.p.identity.dcp_size = 2
        rig.decode_service.p.identity.dcp_rank = 1
        rig.register()
        peer = rig.service.p.peers.get(rig.decode.engine.key)
        assert peer.rejected is None
        rig.new_attempt(5)
        rig.service.control.on_metadata(rig.decode_service.record_destination(
            bootstrap_room=5, required_dst_info_num=1, kv_indices=np.asarray([20, 21, 22, 23]), aux_index=0,
            state_indices=None, decode_prefix_len=2, is_dummy=False))
        assert rig.claim(5) is None
        src = list(range(10, 17))
        view = BatchView([ReqView(room=5, prefix_len=0, extend_len=7, input_len=7, decode_prefix_len=2,
                                  start_send_idx=0, row=np.asarray(src))], page_size=1)
        assert session.begin_batch(view) is None
        assert rig.metrics.fallbacks == ["decode_context_parallel"]
        session.add_chunk(5, np.asarray(src[:4]), slice(0, 4), False, num_kv_tokens=4)
        session.add_chunk(5, np.asarray(src[4:]), slice(4, 7), True, aux_index=0, num_kv_tokens=3)
        rig.wait_status(5, S.SUCCESS)
        expected = {20: 11, 21: 13, 22: 15}  # this rank's absolute positions 3, 5, 7
        for buffer in range(len(rig.decode.kv)):
            for page in range(64):
                want = rig.prefill.page(buffer, expected[page]) if page in expected else bytes(256)
                assert rig.decode.page(buffer, page) == want, (buffer, page)
        assert rig.metrics.layerwise == 0
