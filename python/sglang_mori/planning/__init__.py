"""Page indices -> byte ranges per registered buffer, vectorised with numpy.

The contract with the backend:

1. At registration of a decode rank, build `KVLayout.from_kv_args(...)` on both sides, send the
   decode's layout to the prefill, and construct `TransferPlanner(prefill_layout, decode_layout)`.
   It raises `LayoutMismatchError` / `UnsupportedLayoutError` / `InvalidLayoutError` with a
   message naming both sides' values: refuse the peer there, before any request uses it.
2. Per chunk, `planner.plan_kv(src_pages, dst_pages)` -> `TransferPlan`. Offsets are absolute
   (page index * item_len), so chunks are planned independently; no state crosses chunks.
   With the last chunk, `plan_state(component, src, dst)` per state component (aux bytes ride
   on the Success message, not on a write). Into a decode with context parallelism
   (`planner.dcp_relayout`, dcp.py) call `plan_kv_dcp(src_pages, all_dst_pages, page_offset=...,
   decode_prefix_len=..., num_tokens=...)` instead of `plan_kv`.
3. `plan.as_batch_args()` gives the python lists for one `IOEngine.batch_write`; the indices in
   it select the registered descriptors (KV list, aux list, or the state component's list).
4. Per-chunk problems (out-of-range or unpaired indices) raise `PlanError`: fail that request.
"""

from sglang_mori.planning.compatibility import resolve_total_heads
from sglang_mori.planning.errors import (
    InvalidLayoutError,
    LayoutMismatchError,
    PlanError,
    PlanningError,
    UnsupportedLayoutError,
)
from sglang_mori.planning.head_slice import (
    HeadSlice,
    compute_head_slice,
    decode_ranks_for_prefill_rank,
    head_sliced_ranges,
    rank_heads,
)
from sglang_mori.planning.layer_map import map_kv_buffers
from sglang_mori.planning.layout import KVLayout, StateLayout
from sglang_mori.planning.planner import TransferPlanner, check_compatible
from sglang_mori.planning.ranges import (
    MAX_RANGE_BYTES,
    contiguous_item_ranges,
    index_runs,
    merge_adjacent_ranges,
    split_large_ranges,
)
from sglang_mori.planning.state_rules import STATE_KINDS
from sglang_mori.planning.transfer_plan import BatchArgs, BufferTransfer, TransferPlan

__all__ = [
    "BatchArgs",
    "BufferTransfer",
    "HeadSlice",
    "InvalidLayoutError",
    "KVLayout",
    "LayoutMismatchError",
    "MAX_RANGE_BYTES",
    "PlanError",
    "PlanningError",
    "STATE_KINDS",
    "StateLayout",
    "TransferPlan",
    "TransferPlanner",
    "UnsupportedLayoutError",
    "check_compatible",
    "compute_head_slice",
    "contiguous_item_ranges",
    "decode_ranks_for_prefill_rank",
    "head_sliced_ranges",
    "index_runs",
    "map_kv_buffers",
    "merge_adjacent_ranges",
    "rank_heads",
    "resolve_total_heads",
    "split_large_ranges",
]
