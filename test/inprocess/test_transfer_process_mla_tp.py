"""The transfer process with SGLang's MLA pool shape and with one child per prefill TP rank (session 21's
GPU plan runs both in real SGLang): an MLA pool is one latent buffer per layer (no K / V halves, so an
odd count), and under TP every rank's scheduler spawns its own child, each with its own status table,
control port and channel, serving its own rooms at once."""

from sglang_mori.backend import room_status as S

from transfer_process_rig import TransferProcessRig

MLA_LAYERS = 3  # one latent buffer each: an odd count no K / V split could pair


def test_an_mla_pool_of_one_buffer_per_layer_arrives_byte_for_byte():
    with TransferProcessRig(buffers=MLA_LAYERS, is_mla=True) as rig:
        assert rig.claim(1) is None
        rig.metadata(1, pages=[11, 3, 40])
        rig.wait_status(1, S.WAITING_FOR_INPUT)
        rig.send(1, pages=[6, 7], last=False)
        rig.send(1, pages=[50], last=True, start=2)
        rig.wait_status(1, S.SUCCESS)
        for layer in range(MLA_LAYERS):
            for src, dst in ((6, 11), (7, 3), (50, 40)):
                assert rig.decode.page(layer, dst) == rig.pools.page(layer, src)


def test_two_ranks_children_run_side_by_side_each_on_its_own_table_port_and_rooms():
    with TransferProcessRig() as rank0, TransferProcessRig() as rank1:
        children = (rank0.process, rank1.process)
        assert children[0].process.pid != children[1].process.pid
        assert children[0].port != children[1].port
        assert children[0].table.name != children[1].table.name
        for kv in rank1.pools.kv:  # rank 1's bytes differ from rank 0's: a crossed wire would show
            kv ^= 0xFF
        for rig, room, dst in ((rank0, 7, 20), (rank1, 7, 30)):  # the same room id on both ranks, as under TP
            assert rig.claim(room) is None
            rig.metadata(room, pages=[dst])
        for rig in (rank0, rank1):
            rig.wait_status(7, S.WAITING_FOR_INPUT)
            rig.send(7, pages=[1], last=True)
        for rig, dst in ((rank0, 20), (rank1, 30)):
            rig.wait_status(7, S.SUCCESS)
            for buffer in range(2):
                assert rig.decode.page(buffer, dst) == rig.pools.page(buffer, 1)
