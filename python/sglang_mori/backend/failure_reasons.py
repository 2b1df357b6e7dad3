"""Why rooms fail: the one list of causes, which is also the set of values the metrics "reason"
label may take (metrics.FAILURE_REASONS is ALL; any other value is counted as "other"). Both roles'
failure doors (prefill/failures.py, decode/effects.py) and the retry counter take these names.
test/unit/test_metrics.py checks that every label the code passes is one of them."""

TIMEOUT = "timeout"  # a wait passed its deadline (SGLANG_MORI_TRANSFER_TIMEOUT_MS and friends)
PEER_DEAD = "peer_dead"  # heartbeat loss, pop_peer_failure, retry-exceeded completions
SUBMIT_ERROR = "submit_error"  # batch_write raised or returned a failed status at once (SQ full, no route)
BAD_INDEX = "bad_index"  # page or aux indices out of range of the registered buffers
ABORTED = "aborted"  # the room was aborted by either side
PROTOCOL = "protocol"  # a malformed, unknown or out-of-order control message
LAYOUT = "layout_mismatch"  # peers' KV layouts (TP, page size, buffer count, dtype) do not fit
BACKPRESSURE = "backpressure"  # a transfer shard's queue was full (SGLANG_MORI_MAX_QUEUED_CHUNKS)
OTHER = "other"

ALL = (TIMEOUT, PEER_DEAD, SUBMIT_ERROR, BAD_INDEX, ABORTED, PROTOCOL, LAYOUT, BACKPRESSURE, OTHER)
