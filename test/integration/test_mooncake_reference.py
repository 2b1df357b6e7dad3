"""The harness against SGLang's own Mooncake backend over TCP: a reference implementation moves
the same bytes and passes the same checks, so a failure in the mori tests is the backend's, not
the harness's. One small run; Mooncake binds wildcard addresses, so it needs the private netns."""

from __future__ import annotations

from integration_support import config

from harness.pd.run import KVLayout, RoomShape


def test_mooncake_tcp_reference_run(run_clean, require_netns):
    cfg = config(
        backend="mooncake",
        rooms=16,
        prefill_tp=2,
        decode_tp=1,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=16, page_size=16),
        shape=RoomShape(min_tokens=1, max_tokens=50, chunks=2),
    )
    result = run_clean(cfg)
    assert "mooncake" in result.ready.manager_classes["prefill0"].lower()
