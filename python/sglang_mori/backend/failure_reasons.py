"""Why rooms fail: the metrics label of each cause (metrics.FAILURE_REASONS folds any other value
into "other"), shared by both roles' failure doors (prefill/failures.py, decode/effects.py)."""

TIMEOUT = "timeout"
PEER_DEAD = "peer_dead"
SUBMIT_ERROR = "submit_error"
BAD_INDEX = "bad_index"
ABORTED = "aborted"
PROTOCOL = "protocol"
LAYOUT = "layout_mismatch"
BACKPRESSURE = "backpressure"
OTHER = "other"
