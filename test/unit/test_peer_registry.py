"""PeerRegistry: registration, replacement on restart, rejection, fail-fast window, up count."""

import threading
import time

import pytest

# backend/__init__.py exports lazily, so this imports no SGLang.
from sglang_mori.backend import peers


def up_count(reg) -> int:
    """Peers neither rejected nor inside a fail-fast window (read without ending any window)."""
    return sum(1 for k in reg.keys() if (p := reg.get(k)) and p.failed_reason is None and not p.rejected)

DecodePeer, PeerRegistry = peers.DecodePeer, peers.PeerRegistry

FAIL_FAST_S = 5.0


class Clock:
    """The registry's injected clock."""

    def __init__(self, now=1000.0):
        self.now = now

    def monotonic(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


def peer(key, port=17000, ip="127.0.0.1", **kw):
    return DecodePeer(engine_key=key, endpoint=(ip, port), attn_tp_size=1, attn_tp_rank=0,
                      kv_descs=[b"kv"], aux_descs=[b"aux"], state_descs=[], layout=None, **kw)


def test_add_and_get():
    reg = PeerRegistry(FAIL_FAST_S)
    a, b = peer("a", 1), peer("b", 2)
    assert reg.add(a) is None
    assert reg.add(b) is None
    assert reg.get("a") is a and reg.get("b") is b
    assert reg.get("c") is None
    assert sorted(reg.keys()) == ["a", "b"]
    assert reg.unusable_reason("a") is None
    assert up_count(reg) == 2


def test_restart_same_endpoint_new_key_replaces_old():
    reg = PeerRegistry(FAIL_FAST_S)
    old = peer("decode-pid1", 17000)
    new = peer("decode-pid2", 17000)
    reg.add(old)
    assert reg.add(new) is old
    assert reg.get("decode-pid2") is new
    assert reg.get("decode-pid1") is None
    assert reg.keys() == ["decode-pid2"]
    assert up_count(reg) == 1
    # Rooms still bound to the old key fail with a reason naming it.
    reason = reg.unusable_reason("decode-pid1")
    assert reason == "decode engine decode-pid1 has not registered with this prefill rank"
    assert reg.unusable_reason("decode-pid2") is None


def test_restart_replaces_a_failed_peer_with_a_usable_one(clock):
    reg = PeerRegistry(FAIL_FAST_S, clock=clock.monotonic)
    reg.add(peer("old", 17000))
    reg.mark_failed("old", "peer unreachable")
    assert up_count(reg) == 0
    assert reg.add(peer("new", 17000)).failed_reason == "peer unreachable"
    assert reg.unusable_reason("new") is None
    assert up_count(reg) == 1


def test_same_key_reregistering_is_not_a_replacement():
    reg = PeerRegistry(FAIL_FAST_S)
    first, again = peer("k", 17000), peer("k", 17000)
    reg.add(first)
    assert reg.add(again) is None
    assert reg.get("k") is again
    assert reg.keys() == ["k"]


def test_same_port_other_host_is_a_different_endpoint():
    reg = PeerRegistry(FAIL_FAST_S)
    assert reg.add(peer("a", 17000, ip="127.0.0.1")) is None
    assert reg.add(peer("b", 17000, ip="127.0.0.2")) is None
    assert sorted(reg.keys()) == ["a", "b"]


def test_unregistered_reason():
    reg = PeerRegistry(FAIL_FAST_S)
    assert reg.unusable_reason("ghost") == "decode engine ghost has not registered with this prefill rank"


def test_rejected_peer():
    reg = PeerRegistry(FAIL_FAST_S)
    reg.add(peer("r", rejected="layout mismatch: page_size 16 vs 64"))
    reg.add(peer("ok", 17001))
    assert reg.unusable_reason("r") == "layout mismatch: page_size 16 vs 64"
    assert reg.unusable_reason("ok") is None
    assert up_count(reg) == 1


def test_rejection_outlives_the_fail_fast_window(clock):
    reg = PeerRegistry(FAIL_FAST_S, clock=clock.monotonic)
    reg.add(peer("r", rejected="bad layout"))
    reg.mark_failed("r", "boom")
    clock.now += FAIL_FAST_S * 10
    assert reg.unusable_reason("r") == "bad layout"
    assert up_count(reg) == 0


def test_mark_failed_returns_news():
    reg = PeerRegistry(FAIL_FAST_S)
    reg.add(peer("a"))
    assert reg.mark_failed("a", "first") is True
    assert reg.mark_failed("a", "second") is False
    assert reg.get("a").failed_reason == "second"
    assert reg.mark_failed("unknown", "x") is False
    assert reg.keys() == ["a"]


def test_recently_failed_peer_is_unusable(clock):
    reg = PeerRegistry(FAIL_FAST_S, clock=clock.monotonic)
    reg.add(peer("a"))
    reg.mark_failed("a", "RDMA error on QP 3")
    assert reg.get("a").failed_at == clock.now
    assert reg.unusable_reason("a") == "decode engine a failed recently: RDMA error on QP 3"
    assert up_count(reg) == 0


def test_fail_fast_window_expires(clock):
    reg = PeerRegistry(FAIL_FAST_S, clock=clock.monotonic)
    reg.add(peer("a"))
    reg.add(peer("b", 17001))
    reg.mark_failed("a", "peer unreachable")
    assert up_count(reg) == 1

    clock.now += FAIL_FAST_S - 0.001
    assert reg.unusable_reason("a") == "decode engine a failed recently: peer unreachable"
    assert up_count(reg) == 1

    clock.now += 0.001  # exactly fail_fast_s after the failure: the window is over
    assert reg.unusable_reason("a") is None
    p = reg.get("a")
    assert (p.failed_reason, p.failed_at) == (None, None)
    assert up_count(reg) == 2
    # A new failure is news again and opens a new window.
    assert reg.mark_failed("a", "again") is True
    assert reg.unusable_reason("a") == "decode engine a failed recently: again"


def test_repeated_failure_restarts_the_window(clock):
    reg = PeerRegistry(FAIL_FAST_S, clock=clock.monotonic)
    reg.add(peer("a"))
    reg.mark_failed("a", "first")
    clock.now += 4.0
    reg.mark_failed("a", "second")
    clock.now += 4.0  # 8 s after the first failure, 4 s after the second
    assert reg.unusable_reason("a") == "decode engine a failed recently: second"
    clock.now += 1.0
    assert reg.unusable_reason("a") is None


def test_zero_window_never_fails_fast(clock):
    reg = PeerRegistry(0.0, clock=clock.monotonic)
    reg.add(peer("a"))
    reg.mark_failed("a", "x")
    assert reg.unusable_reason("a") is None


def test_concurrent_adds_keep_one_key_per_endpoint():
    reg = PeerRegistry(FAIL_FAST_S)
    n_threads, per_thread = 8, 50
    barrier = threading.Barrier(n_threads)

    def worker(t):
        barrier.wait(timeout=10)
        for i in range(per_thread):
            reg.add(peer(f"t{t}-{i}", 17000 + i % 4))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    assert not any(th.is_alive() for th in threads)
    keys = reg.keys()
    assert len(keys) == 4
    assert sorted(reg.get(k).endpoint[1] for k in keys) == [17000, 17001, 17002, 17003]
    assert up_count(reg) == 4


def test_prune_dead_forgets_broken_silent_idle_peers_only(clock):
    reg = PeerRegistry(FAIL_FAST_S, clock=clock.monotonic)
    dead, busy, chatty, healthy = peer("dead", 1), peer("busy", 2), peer("chatty", 3), peer("ok", 4)
    for p in (dead, busy, chatty, healthy):
        reg.add(p)
    for key in ("dead", "busy", "chatty"):
        reg.mark_failed(key, "lane broke")
    assert reg.budget.acquire("busy", deadline=clock.now + 1)  # one write in flight
    clock.now += 60
    reg.touch("chatty")  # it sent room metadata: not gone
    # Past the fail-fast window the failure is forgotten for use, but not for pruning.
    assert reg.unusable_reason("dead") is None
    assert reg.prune_dead(100.0) == []  # too early for everybody
    clock.now += 50
    assert [p.engine_key for p in reg.prune_dead(100.0)] == ["dead"]
    assert reg.get("dead") is None and reg.get("busy") is busy and reg.get("chatty") is chatty
    assert reg.unusable_reason("dead") == "decode engine dead has not registered with this prefill rank"
    # Its endpoint is free again: a new engine there replaces nobody.
    assert reg.add(peer("dead2", 1)) is None
    reg.budget.release("busy")
    clock.now += 100
    assert {p.engine_key for p in reg.prune_dead(100.0)} == {"busy", "chatty"}
    assert reg.get("ok") is healthy and reg.get("dead2") is not None


def test_inflight_budget_bounds_each_peer_and_waits_until_the_deadline():
    now = [0.0]
    budget = peers.InflightBudget(2, clock=lambda: now[0])
    assert budget.acquire("a", deadline=1.0) and budget.acquire("a", deadline=1.0)
    assert budget.acquire("b", deadline=1.0)  # another peer has its own budget
    now[0] = 2.0  # past the deadline: no wait, refused
    assert budget.acquire("a", deadline=1.0) is peers.Admission.TIMED_OUT
    assert budget.snapshot() == {"a": 2, "b": 1} and budget.total() == 3
    budget.release("a")
    assert budget.acquire("a", deadline=1.0)
    budget.release("a", 2)
    budget.release("b")
    assert budget.total() == 0 and budget.snapshot() == {}


def test_inflight_budget_wakes_a_waiter_on_release():
    budget = peers.InflightBudget(1)
    assert budget.acquire("a", deadline=float("inf"))
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.acquire("a", deadline=time.monotonic() + 30)))
    waiter.start()
    budget.release("a")
    waiter.join(timeout=30)
    assert [bool(g) for g in got] == [True] and budget.count("a") == 1


def _held(budget, n):
    end = time.monotonic() + 30
    while budget.holding != n:  # bounded poll of the budget's own state, not a sleep as a guess
        assert time.monotonic() < end, f"{n} held batches"
        time.sleep(0.002)


def test_byte_budget_holds_past_its_bound_and_posts_a_larger_batch_alone():
    now = [0.0]
    budget = peers.InflightBudget(64, clock=lambda: now[0], byte_limit=1000)
    assert budget.acquire("a", 1.0, 600) is peers.Admission.ADMITTED
    assert budget.acquire("a", 1.0, 400) is peers.Admission.ADMITTED  # exactly the bound
    now[0] = 2.0
    assert budget.acquire("a", 1.0, 1) is peers.Admission.TIMED_OUT  # held until its deadline
    assert budget.acquire("b", 1.0, 5000) is peers.Admission.ADMITTED  # nothing in flight to b: alone
    assert budget.acquire("b", 1.0, 1) is peers.Admission.TIMED_OUT
    budget.release("a", nbytes=600)
    assert budget.posted_bytes("a") == 400 and budget.count("a") == 1
    budget.release("a", nbytes=400), budget.release("b", nbytes=5000)
    assert budget.total_bytes() == 0 and budget.holding == 0


def test_byte_budget_zero_is_unbounded():
    budget = peers.InflightBudget(64, byte_limit=0)
    for _ in range(10):
        assert budget.acquire("a", 0.0, 1 << 40) is peers.Admission.ADMITTED


def test_held_batches_are_admitted_in_arrival_order():
    budget = peers.InflightBudget(64, byte_limit=1000)
    assert budget.acquire("a", 0.0, 600)
    order = []

    def hold(name, nbytes):
        order.append((name, budget.acquire("a", time.monotonic() + 30, nbytes)))

    first = threading.Thread(target=hold, args=("big", 800))
    first.start()
    _held(budget, 1)
    second = threading.Thread(target=hold, args=("small", 100))  # would fit now, but comes second
    second.start()
    _held(budget, 2)
    assert budget.posted_bytes("a") == 600
    budget.release("a", nbytes=600)
    first.join(30), second.join(30)
    assert order == [("big", peers.Admission.ADMITTED_AFTER_HOLD), ("small", peers.Admission.ADMITTED_AFTER_HOLD)]
    assert budget.posted_bytes("a") == 900


def test_a_held_batch_whose_room_ended_is_dropped_when_woken():
    budget = peers.InflightBudget(64, byte_limit=1000)
    assert budget.acquire("a", 0.0, 1000)
    ended = threading.Event()
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.acquire("a", time.monotonic() + 30, 10, ended.is_set)))
    waiter.start()
    _held(budget, 1)
    ended.set()
    budget.wake()
    waiter.join(30)
    assert got == [peers.Admission.ABANDONED] and not got[0]
    assert budget.posted_bytes("a") == 1000 and budget.holding == 0


def test_byte_budget_with_a_stall_window_binds_only_for_a_stalled_peer():
    now = [0.0]
    budget = peers.InflightBudget(64, clock=lambda: now[0], byte_limit=1000, stall_s=0.5)
    assert budget.acquire("a", 1.0, 800) is peers.Admission.ADMITTED  # idle peer: its clock starts
    now[0] = 0.4
    assert not budget.stalled("a")
    assert budget.acquire("a", 1.0, 800) is peers.Admission.ADMITTED  # past the bound, still progressing
    now[0] = 0.9  # nothing finished for 0.9 s
    assert budget.stalled("a")
    assert budget.acquire("a", 0.9, 1) is peers.Admission.TIMED_OUT  # held (deadline already passed)
    budget.release("a", nbytes=800)  # a write finished: progress
    assert not budget.stalled("a")
    assert budget.acquire("a", 0.9, 800) is peers.Admission.ADMITTED  # 1600 in flight, but progressing
    budget.release("a", count=2, nbytes=1600)
    assert not budget.stalled("a") and budget.total_bytes() == 0  # nothing in flight: never stalled


def test_try_acquire_takes_only_what_acquire_would_admit_at_once():
    """A transfer shard asks without waiting (it sends a chunk it would hold on to another shard):
    a refusal takes nothing and queues nothing, and never overtakes a held batch."""
    budget = peers.InflightBudget(64, byte_limit=1000)
    assert budget.try_acquire("a", 800)
    assert not budget.try_acquire("a", 300)  # past the bound
    assert (budget.count("a"), budget.posted_bytes("a"), budget.holding) == (1, 800, 0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.acquire("a", time.monotonic() + 30, 300)))
    waiter.start()
    _held(budget, 1)
    assert not budget.try_acquire("a", 100)  # would fit, but a held batch came first
    budget.release("a", nbytes=800)
    waiter.join(30)
    assert got == [peers.Admission.ADMITTED_AFTER_HOLD]
    assert budget.try_acquire("b", 5000)  # an idle peer: a batch over the bound goes alone
    assert (budget.posted_bytes("a"), budget.posted_bytes("b")) == (300, 5000)


def test_budget_is_idle_only_while_no_write_is_in_flight_to_any_peer():
    # A shard skips its stalled-decode check on this answer: it must never read idle while a
    # write to some peer is still counted.
    budget = peers.InflightBudget(4, stall_s=0.0)
    assert budget.idle()
    assert budget.try_acquire("a", 10) and budget.try_acquire("b", 10)
    assert not budget.idle()
    budget.release("a", nbytes=10)
    assert not budget.idle() and budget.stalled("b")
    budget.release("b", nbytes=10)
    assert budget.idle() and not budget.stalled("b")
