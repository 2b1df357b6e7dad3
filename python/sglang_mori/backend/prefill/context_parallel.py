"""Which bytes this prefill rank sends under prefill context parallelism (CP) and KV sharding.

SGLang 0.5.23 picks the KV pages each CP rank sends before our code sees them
(`CommonKVSender._prepare_send_indices`): with `enable_all_cp_ranks_for_transfer` every CP rank
gets its own contiguous page range of the request, with KV sharding each rank gets the logical
pages it stores, and otherwise ranks other than CP rank 0 send nothing and report Success only
locally. What it leaves to the backend, and what this class decides:

- state that every CP rank holds alike goes from CP rank 0 only (SGLang's
  `_should_skip_cp_replicated_state_transfer`, mirrored here and unit-tested against it);
- aux goes from one rank, so every other rank's Success carries none;
- a decode that expects Successes from another set of CP ranks than the ones that send, and the
  topologies whose bytes we cannot place, are refused when the decode registers, naming both
  sides' values, instead of leaving decode short of pages or waiting for a Success never sent.

Pure: built from the manager's values (`sglang_fields.prefill_cp`), or directly in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sglang_mori.planning.errors import UnsupportedLayoutError
from sglang_mori.planning.kv_shard import SHARDED_STATE_TYPE

ALL_CP_RANKS_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"


@dataclass(frozen=True)
class PrefillCP:
    cp_size: int = 1
    cp_rank: int = 0
    # SGLang's enable_all_cp_ranks_for_transfer: every CP rank sends its share of the KV pages.
    all_ranks_send: bool = False
    # CP-TP group sharing: CP rank r registers as TP rank r of a CP-1 prefill.
    tp_group_sharing: bool = False
    dsa_layer_split: bool = False
    kv_shard_size: int = 1
    kv_shard_rank: int = 0

    @property
    def sharded(self) -> bool:
        return self.kv_shard_size > 1

    @property
    def decode_sees_cp(self) -> bool:
        """Whether decode sees CP ranks at all (CP-TP group sharing registers them as TP ranks)."""
        return self.cp_size > 1 and not self.tp_group_sharing

    @property
    def skips_replicated_state(self) -> bool:
        """SGLang's rule: every CP rank holds the same state, so ranks other than 0 omit it;
        except when each CP rank holds other state (DSA layer split, CP-TP group sharing, where
        rank r holds linear-attention head shard r) or other pages of it (KV sharding)."""
        return (self.cp_size > 1 and self.cp_rank != 0 and not self.dsa_layer_split
                and not self.tp_group_sharing and not self.sharded)

    @property
    def owns_aux(self) -> bool:
        """Aux is computed alike on every CP and shard rank: CP rank 0 (shard rank 0) sends it.
        Under CP-TP group sharing each CP rank is the only prefill rank of its decode rank."""
        return (self.tp_group_sharing or self.cp_rank == 0) and self.kv_shard_rank == 0

    def decode_pulls_all(self, decode_all_cp_ranks: bool) -> bool:
        """Whether a decode pulls from (and waits for a Success of) every CP rank: SGLang's
        `_resolve_rank_mapping`, from the decode's own flag and this prefill's."""
        return bool(decode_all_cp_ranks) or self.dsa_layer_split or self.sharded

    def check_decode(self, *, decode_all_cp_ranks: bool, decode_tp_size: int,
                     state_types: Sequence[str]) -> None:
        """Raise UnsupportedLayoutError, naming both sides' values, for a decode this rank
        cannot serve byte-exact with every byte sent once."""
        me = f"prefill attn_cp_size={self.cp_size} cp_rank={self.cp_rank}"
        if self.tp_group_sharing:
            raise UnsupportedLayoutError(
                f"{me} with CP-TP group sharing (registered as attention TP {self.cp_size}), decode "
                f"attn_tp_size={decode_tp_size}: each CP rank holds every KV head but only its shard "
                "of the linear-attention state, and the planner lays both over one TP size"
            )
        if self.dsa_layer_split:
            raise UnsupportedLayoutError(
                f"{me} with --enable-dsa-cache-layer-split, decode attn_tp_size={decode_tp_size}: "
                "each CP rank registers other layers' buffers, which the planner does not pair"
            )
        if self.decode_sees_cp:
            pulls_all = self.decode_pulls_all(decode_all_cp_ranks)
            if pulls_all != self.all_ranks_send:
                sends = "every CP rank sends its share of the pages" if self.all_ranks_send \
                    else "only CP rank 0 sends"
                pulls = f"waits for all {self.cp_size} CP ranks" if pulls_all else "pulls from CP rank 0 only"
                raise UnsupportedLayoutError(
                    f"{me}: {sends} (all_cp_ranks_transfer={self.all_ranks_send}), decode {pulls} "
                    f"(all_cp_ranks_transfer={bool(decode_all_cp_ranks)}); set {ALL_CP_RANKS_ENV} "
                    "alike on both servers"
                )
        if self.sharded:
            other = [t for t in state_types if t != SHARDED_STATE_TYPE]
            if other:
                raise UnsupportedLayoutError(
                    f"prefill kv_shard_size={self.kv_shard_size} kv_shard_rank={self.kv_shard_rank} with "
                    f"state types {other}, decode attn_tp_size={decode_tp_size}: only "
                    f"{SHARDED_STATE_TYPE!r} state is known to be striped like the KV pages"
                )
