"""Page lists of a KV-sharded prefill (SGLang `--enable-kv-cache-sharding`), narrowed to one owner.

With KV sharding, logical page `l` of a request is stored on shard rank `l % N` as its local page
`l // N`. SGLang narrows the KV page list before our sender sees it, but hands state page lists
over whole; for the state striped like the KV pages (DSA index pages) each shard rank must send
only the pages it stores, to the decode slots they pair with, so every page goes once and from
the rank that holds it (what Mooncake does for DSA).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from sglang_mori.planning.errors import PlanError

# The state type SGLang's KV sharding stripes like the KV pages (Mooncake narrows its page lists
# to each owner); no other state component is known to be striped, or replicated, under sharding.
SHARDED_STATE_TYPE = "dsa"


def owned_pages(src_pages, dst_pages, shard_rank: int, shard_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(this rank's local page ids, the decode pages they go to) for paired logical page lists."""
    if shard_size < 1 or not 0 <= shard_rank < shard_size:
        raise PlanError(f"kv_shard_rank={shard_rank} with kv_shard_size={shard_size}")
    src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if src.size != dst.size:
        # Positional pairing: a shorter list on either side would send pages to the wrong slots.
        raise PlanError(f"sharded state page lists differ in length: prefill={src.size} decode={dst.size}")
    mine = src % shard_size == shard_rank
    return src[mine] // shard_size, dst[mine]
