"""Layer-wise hooks under SGLang's breakable prefill CUDA graph, on a GPU.

A PD prefill server keeps SGLang 0.5.23's prefill CUDA graph on: a forward replays captured
segments, and only the eager breaks between them (each layer's attention, `@eager_on_graph`) run
Python. Our attention hook wraps `AttentionBackend.forward` (through SGLang's HookRegistry, as the
plugin registers it), so it must run at every replay, inside the break, after that replay's KV
store, with the batch published for that replay; and nothing of it may be captured into the graph.

Here a small model (per layer: projections in the graph, attention as an eager break whose
backend stores K into a pool after ~1 ms of GPU sleep, then more graph) is captured with SGLang's
own BreakableCUDAGraphCapture while no batch is published (as at server start-up), and replayed:
- the capture made one break per layer and called the hook's session never;
- each replay with a published batch calls the session once per layer, in order, with that
  replay's batch, outside any capture, and the layer's device event orders a read after that
  replay's store: a copy that waits on it sees exactly the layer's K (the pool is poisoned with
  NaN before each replay), while a copy that does not wait sees the poison (so the check can fail);
- a replay with no batch published calls nothing.
"""

from __future__ import annotations

import threading

import pytest

LAYERS, TOKENS, HIDDEN = 4, 256, 512
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time before each layer's KV store


class Layer:
    """What RadixAttention hands the backend: the layer id is all the hook reads."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id


class Published:
    """The session's view of a published batch (the hook reads .stopped and .pool)."""

    def __init__(self, pool):
        self.stopped = False
        self.pool = pool


class RecordingSession:
    """Stands in for the layer-wise session: records each on_layer, and copies the layer's pool
    slice on a side stream twice, once after waiting on the hook's event and once without."""

    def __init__(self, torch):
        self.torch = torch
        self.side = torch.cuda.Stream()
        self.calls = []
        self.lock = threading.Lock()

    def on_layer(self, batch, pool, layer_id, event=None):
        torch = self.torch
        capturing = torch.cuda.is_current_stream_capturing()
        with torch.cuda.stream(self.side):
            unwaited = pool[layer_id].clone()
            if event is not None:
                self.side.wait_event(event)
            waited = pool[layer_id].clone()
        with self.lock:
            self.calls.append({"batch": batch, "layer": layer_id, "capturing": capturing,
                               "event": event, "waited": waited, "unwaited": unwaited})


@pytest.fixture(scope="module")
def env():
    torch = pytest.importorskip("torch")
    bcg = pytest.importorskip(
        "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph")
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_mori.backend.prefill.layerwise import hooks
    from sglang_mori.backend.sglang_manifest import ATTENTION_TARGET
    from sglang_mori.plugin import _lazy_hook

    original = AttentionBackend.__dict__["forward"]
    HookRegistry.register(ATTENTION_TARGET, _lazy_hook("around_attention_forward"), HookType.AROUND)
    HookRegistry.apply_hooks()
    try:
        yield torch, bcg, AttentionBackend, ForwardMode, hooks
    finally:
        AttentionBackend.forward = original
        HookRegistry.reset()


def build(torch, bcg, AttentionBackend, ForwardMode):
    class StoreBackend(AttentionBackend):
        """Stores K into the pool (after a GPU sleep, so the store runs late), returns Q + V."""

        def __init__(self, pool):
            self.pool = pool

        def init_forward_metadata(self, forward_batch):
            pass

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            torch.cuda._sleep(SLEEP_CYCLES)
            self.pool[layer.layer_id].copy_(k)
            return q + v

    class Batch:
        forward_mode = ForwardMode.EXTEND

    g = torch.Generator(device="cuda").manual_seed(27)
    weights = [[torch.randn(HIDDEN, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5 for _ in range(4)]
               for _ in range(LAYERS)]
    layers = [Layer(i) for i in range(LAYERS)]
    batch = Batch()

    @bcg.eager_on_graph
    def attention(q, k, v, layer, forward_batch, backend):
        return backend.forward(q, k, v, layer, forward_batch)

    def forward(x, backend):
        h = x
        for i, (wq, wk, wv, wo) in enumerate(weights):
            a = attention(h @ wq, h @ wk, h @ wv, layers[i], batch, backend)
            h = torch.tanh(a @ wo) + h
        return h

    return StoreBackend, forward


def test_hooks_run_at_replay_in_the_eager_breaks_and_are_never_captured(env):
    torch, bcg, AttentionBackend, ForwardMode, hooks = env
    StoreBackend, forward = build(torch, bcg, AttentionBackend, ForwardMode)
    pool = torch.full((LAYERS, TOKENS, HIDDEN), float("nan"), device="cuda")
    backend = StoreBackend(pool)
    x = torch.randn(TOKENS, HIDDEN, device="cuda")
    session = RecordingSession(torch)
    hooks._current.published = None

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(x, backend)  # warm-up (cuBLAS handles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = bcg.BreakableCUDAGraph()
    with bcg.BreakableCUDAGraphCapture(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
        out = forward(x, backend)
    torch.cuda.synchronize()
    assert len(graph._break_fns) == LAYERS, "each layer's attention is an eager break"
    assert len(graph._segments) == LAYERS + 1
    assert session.calls == [], "nothing published at capture: the hook did nothing"

    ref_pool = torch.empty_like(pool)
    ref_backend = StoreBackend(ref_pool)
    for replay in range(3):
        x.copy_(torch.randn(TOKENS, HIDDEN, device="cuda"))
        pool.fill_(float("nan"))
        forward(x, ref_backend)  # eager reference of this input's K per layer
        torch.cuda.synchronize()
        published = Published(pool)
        session.calls.clear()
        hooks._current.published = (session, published)
        try:
            graph.replay()
        finally:
            hooks._current.published = None
        torch.cuda.synchronize()
        calls = list(session.calls)
        assert [c["layer"] for c in calls] == list(range(LAYERS)), f"replay {replay}"
        assert all(c["batch"] is published for c in calls), "the replay's own batch, read at replay"
        assert not any(c["capturing"] for c in calls), "the hook runs in the eager break, not in a capture"
        assert all(c["event"] is not None and c["event"].query() for c in calls)
        for c in calls:
            assert torch.allclose(c["waited"], ref_pool[c["layer"]], rtol=1e-4, atol=1e-4), (
                f"replay {replay} layer {c['layer']}: a read ordered after the hook's event saw "
                "other bytes than this replay's K")
        assert any(torch.isnan(c["unwaited"]).any() for c in calls), (
            "without the event the read ran before the delayed store (else this check cannot fail)")
        assert torch.isfinite(out).all()

    session.calls.clear()
    graph.replay()  # nothing published
    torch.cuda.synchronize()
    assert session.calls == [], "no hook effect was baked into the graph"
