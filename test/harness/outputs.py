"""The e2e suite's one verdict on generated tokens: PD's greedy outputs equal the reference's."""

from __future__ import annotations

from typing import Sequence


def assert_same_tokens(refs: Sequence, ours: Sequence, what: str) -> None:
    """Every reference and PD request succeeded, and each PD output's token ids equal the
    reference's for the same prompt (client.Generation results, in prompt order)."""
    assert all(r.ok for r in refs), [(r.status, r.error[:200]) for r in refs if not r.ok]
    failed = [(i, r.status, r.error[:300]) for i, r in enumerate(ours) if not r.ok]
    assert not failed, f"{what} requests failed: {failed}"
    mismatches = [f"prompt {i}: PD {o.output_ids} standalone {r.output_ids}"
                  for i, (o, r) in enumerate(zip(ours, refs)) if o.output_ids != r.output_ids]
    assert not mismatches, f"{len(mismatches)}/{len(ours)} {what} outputs differ:\n" + "\n".join(mismatches)
