"""A planned BufferTransfer's ranges as python ints, for tests that replay or compare plans."""


def ranges(transfer):
    """(local_offsets, remote_offsets, sizes) of one BufferTransfer as int lists."""
    return transfer.local_offsets.tolist(), transfer.remote_offsets.tolist(), transfer.sizes.tolist()
