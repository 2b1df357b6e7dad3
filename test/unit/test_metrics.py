"""sglang_mori.metrics: values, bounded labels, idempotent creation, multiprocess mode."""

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from prometheus_client import CollectorRegistry

from sglang_mori import metrics
from sglang_mori.metrics import (
    FAILURE_REASONS,
    NullTransferMetrics,
    TransferMetrics,
    create_transfer_metrics,
    normalize_reason,
)

LABELS = {"engine_type": "prefill", "tp_rank": "1", "pp_rank": "0", "dp_rank": "0"}


def value(reg, name, **extra):
    v = reg.get_sample_value(name, {**LABELS, **extra})
    return 0.0 if v is None else v


@pytest.fixture()
def reg():
    return CollectorRegistry()


def make(reg):
    return TransferMetrics("prefill", tp_rank=1, registry=reg)


def test_successful_transfer_counts_bytes_latency_and_inflight(reg):
    m = make(reg)
    m.transfer_started("peerA")
    m.transfer_started("peerA")
    m.transfer_started("peerB")
    assert value(reg, "sglang_mori_inflight_transfers") == 3
    assert value(reg, "sglang_mori_inflight_max_per_peer") == 2
    m.transfer_finished("peerA", 4096, 0.002, ok=True)
    assert value(reg, "sglang_mori_inflight_transfers") == 2
    assert value(reg, "sglang_mori_inflight_max_per_peer") == 1
    assert value(reg, "sglang_mori_transfers_total", outcome="ok") == 1
    assert value(reg, "sglang_mori_transfer_bytes_total") == 4096
    assert value(reg, "sglang_mori_transfer_latency_seconds_count") == 1
    assert value(reg, "sglang_mori_transfer_latency_seconds_sum") == pytest.approx(0.002)
    # 2 ms lands in the 2.5 ms bucket, not the 1 ms one.
    assert value(reg, "sglang_mori_transfer_latency_seconds_bucket", le="0.001") == 0
    assert value(reg, "sglang_mori_transfer_latency_seconds_bucket", le="0.0025") == 1


def test_failed_transfer_counts_reason_not_bytes(reg):
    m = make(reg)
    m.transfer_started("p")
    m.transfer_finished("p", 1 << 20, 5.0, ok=False, reason="timeout")
    assert value(reg, "sglang_mori_transfers_total", outcome="failed") == 1
    assert value(reg, "sglang_mori_transfer_failures_total", reason="timeout") == 1
    # A failed transfer is not a failed request: the request level is counted separately, once.
    assert value(reg, "sglang_mori_failures_total", reason="timeout") == 0
    m.request_finished(False, reason="timeout")
    assert value(reg, "sglang_mori_failures_total", reason="timeout") == 1
    assert value(reg, "sglang_mori_requests_total", outcome="failed") == 1
    assert value(reg, "sglang_mori_transfer_bytes_total") == 0
    assert value(reg, "sglang_mori_transfer_latency_seconds_count") == 0
    assert value(reg, "sglang_mori_inflight_transfers") == 0


def test_reason_labels_are_bounded(reg):
    m = make(reg)
    m.failure("Peer-Dead")
    m.failure("ERR_RDMA_OP: transport retry limit exceeded")  # free text -> other
    m.failure(None)
    m.retry("submit_error")
    m.retry("SQ full")
    assert normalize_reason("LAYOUT_MISMATCH") == "layout_mismatch"
    assert value(reg, "sglang_mori_failures_total", reason="peer_dead") == 1
    assert value(reg, "sglang_mori_failures_total", reason="other") == 2
    assert value(reg, "sglang_mori_retries_total", reason="submit_error") == 1
    assert value(reg, "sglang_mori_retries_total", reason="other") == 1
    seen = {s.labels["reason"] for fam in reg.collect() for s in fam.samples if "reason" in s.labels}
    assert seen <= set(FAILURE_REASONS)


def test_requests_queue_and_peers(reg):
    m = make(reg)
    assert value(reg, "sglang_mori_requests_total", outcome="ok") == 0  # pre-touched series
    m.request_finished(True)
    m.request_finished(False)  # reason counted separately by failure(): not here
    assert value(reg, "sglang_mori_failures_total", reason="other") == 0
    m.set_queue_depth(7)
    assert reg.get_sample_value("sglang_mori_open_rooms", LABELS) == 0  # exported before any room
    m.set_open_rooms(3)
    assert value(reg, "sglang_mori_open_rooms") == 3
    m.set_open_rooms(0)
    assert value(reg, "sglang_mori_open_rooms") == 0
    assert value(reg, "sglang_mori_requests_total", outcome="ok") == 1
    assert value(reg, "sglang_mori_requests_total", outcome="failed") == 1
    assert value(reg, "sglang_mori_queue_depth") == 7
    m.peer_up("d0")
    m.peer_up("d0")
    m.peer_up("d1")
    assert value(reg, "sglang_mori_peers_up") == 2
    m.peer_down("d0")
    m.peer_down("d0")
    m.peer_down("never-seen")
    assert value(reg, "sglang_mori_peers_up") == 1
    assert value(reg, "sglang_mori_peer_down_total") == 1


def test_finish_without_start_never_goes_negative(reg):
    m = make(reg)
    m.transfer_finished("ghost", 10, 0.1, ok=True)
    assert value(reg, "sglang_mori_inflight_transfers") == 0


def test_two_managers_share_collectors_and_state(reg):
    a, b = make(reg), make(reg)  # second creation must not raise "Duplicated timeseries"
    a.transfer_started("p")
    b.transfer_started("p")
    assert value(reg, "sglang_mori_inflight_transfers") == 2
    a.peer_up("x")
    b.peer_up("y")
    assert value(reg, "sglang_mori_peers_up") == 2
    other = TransferMetrics("decode", tp_rank=1, registry=reg)
    other.transfer_started("p")
    assert reg.get_sample_value("sglang_mori_inflight_transfers",
                                {**LABELS, "engine_type": "decode"}) == 1
    assert value(reg, "sglang_mori_inflight_transfers") == 2


def test_module_imported_twice_reuses_collectors(reg):
    make(reg).transfer_started("p")
    spec = importlib.util.spec_from_file_location("sglang_mori_metrics_copy", metrics.__file__)
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(copy)
    finally:
        del sys.modules[spec.name]
    copy.TransferMetrics("prefill", tp_rank=1, registry=reg).transfer_started("p")
    assert value(reg, "sglang_mori_inflight_transfers") == 2


def test_concurrent_workers_balance_to_zero(reg):
    m = make(reg)

    def worker(i):
        for _ in range(200):
            m.transfer_started(f"peer{i % 3}")
            m.transfer_finished(f"peer{i % 3}", 1, 0.0001, ok=True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert value(reg, "sglang_mori_inflight_transfers") == 0
    assert value(reg, "sglang_mori_transfers_total", outcome="ok") == 1200


def test_null_metrics_has_the_same_api():
    def api(cls):
        return {n: str(inspect.signature(f)) for n, f in inspect.getmembers(cls, inspect.isfunction)
                if not n.startswith("_")}

    assert api(NullTransferMetrics) == api(TransferMetrics)
    null = create_transfer_metrics(False, "decode")
    assert isinstance(null, NullTransferMetrics)
    null.transfer_finished("p", 1, 0.1, ok=False, reason="timeout")
    assert isinstance(create_transfer_metrics(True, "decode", registry=CollectorRegistry()),
                      TransferMetrics)


def test_module_import_does_not_import_prometheus_client():
    # prometheus_client fixes its value store on import; SGLang sets PROMETHEUS_MULTIPROC_DIR after
    # loading plugins, so importing our module must leave prometheus_client unimported.
    code = "import sys, sglang_mori.metrics; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# One "scheduler process": writes its series into PROMETHEUS_MULTIPROC_DIR as SGLang's would.
_CHILD = textwrap.dedent("""
    import sys
    from sglang_mori.metrics import TransferMetrics
    rank = int(sys.argv[1])
    m = TransferMetrics("prefill", tp_rank=rank)
    m.transfer_started("d"); m.transfer_started("d"); m.transfer_started("e")
    m.transfer_finished("d", 1000 * (rank + 1), 0.01, ok=True)
    m.transfer_finished("e", 0, 9.0, ok=False, reason="timeout")
    m.set_queue_depth(rank + 5)
    m.peer_up("d")
    m.request_finished(True)
""")


def test_prometheus_multiprocess_mode(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for rank in (0, 1):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(rank)], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    # The HTTP server side: a fresh registry merging the files, as sglang's add_prometheus_middleware.
    reader = textwrap.dedent("""
        import json
        from prometheus_client import CollectorRegistry, multiprocess
        reg = CollectorRegistry(); multiprocess.MultiProcessCollector(reg)
        print(json.dumps([[s.name, s.labels, s.value] for f in reg.collect() for s in f.samples]))
    """)
    out = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    samples = json.loads(out.stdout)

    def get(name, rank=None, **extra):
        hits = [v for n, lab, v in samples if n == name
                and (rank is None or lab.get("tp_rank") == str(rank))
                and all(lab.get(k) == x for k, x in extra.items())]
        return hits

    for rank in (0, 1):
        assert get("sglang_mori_inflight_transfers", rank) == [1.0]  # one per process, no pid label
        assert get("sglang_mori_queue_depth", rank) == [rank + 5.0]
        assert get("sglang_mori_peers_up", rank) == [1.0]
        assert get("sglang_mori_transfer_bytes_total", rank) == [1000.0 * (rank + 1)]
    assert sum(get("sglang_mori_transfer_failures_total", reason="timeout")) == 2
    assert sum(get("sglang_mori_transfer_latency_seconds_count")) == 2
    assert all("pid" not in lab for _, lab, _ in samples)
