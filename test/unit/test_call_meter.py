"""SGLANG_MORI_CALL_METER (python/sglang_mori/call_meter.py): SGLang's calls into our classes timed on
the calling thread (outermost call only, our threads' calls left to their thread's CPU), the hooks'
own CPU without the function they wrap, the snapshots' sums per request, and off = untouched."""

import threading
import time

import pytest

from sglang_mori import call_meter
from sglang_mori.call_meter import Meter


def burn(ms: float) -> None:
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass


class Base:  # stands for SGLang's Common* class
    def poll(self):
        return self.check()

    def check(self):
        burn(2)
        return "ok"


def make_classes():
    class MoriKVSender(Base):
        def __init__(self, room):
            self.room = room

        def send(self, n):
            burn(n)
            return n

        def _private(self):
            return "untimed"

    return MoriKVSender


def test_wrapping_times_inherited_and_own_methods_on_our_class_only(tmp_path):
    meter = Meter(str(tmp_path))
    meter.role = "prefill"
    Sender = make_classes()
    base_poll = Base.poll
    meter.wrap_class(Sender)
    meter.wrap_class(Sender)  # idempotent: not wrapped twice
    assert Base.poll is base_poll and "poll" in vars(Sender) and not hasattr(Sender._private, "__sglang_mori_metered__")
    s = Sender(1)
    assert s.send(3) == 3 and s.poll() == "ok" and s._private() == "untimed"
    calls = meter.snapshot()["calls"]
    # poll calls check inside: one outermost call, check not counted apart
    assert calls["MoriKVSender.poll"][0] == 1 and "MoriKVSender.check" not in calls
    assert calls["MoriKVSender.send"][0] == 1 and 2.5e6 < calls["MoriKVSender.send"][1] < 30e6
    assert 1.5e6 < calls["MoriKVSender.poll"][1] < 30e6
    assert meter.snapshot()["requests"] == 1  # one sender built on a prefill process


def test_calls_from_our_threads_are_left_to_their_threads_cpu(tmp_path):
    meter = Meter(str(tmp_path))
    Sender = make_classes()
    meter.wrap_class(Sender)
    t = threading.Thread(target=lambda: Sender(0).send(5), name="mori-shard-0")
    t.start()
    t.join()
    assert meter.snapshot()["calls"] == {}
    other = threading.Thread(target=lambda: Sender(0).send(1), name="sglang-thread")
    other.start()
    other.join()
    assert meter.snapshot()["callers"].keys() == {"sglang-thread"}


def test_a_hook_counts_its_own_cpu_not_the_function_it_wraps(tmp_path):
    meter = Meter(str(tmp_path))

    def original(x):
        burn(20)
        return x + 1

    def hook(orig, x):
        burn(3)
        return orig(x) * 2

    assert meter.hook("hooks.run_batch", hook, original, 1) == 4
    n, ns, _ = meter.snapshot()["calls"]["hooks.run_batch"]
    assert n == 1 and 2.5e6 < ns < 15e6  # the hook's 3 ms, not the original's 20


def test_our_threads_cpu_is_read_by_role_and_kept_after_they_end(tmp_path):
    meter = Meter(str(tmp_path))
    stop, done = threading.Event(), [threading.Event() for _ in range(3)]

    def work(i):
        burn(5)
        done[i].set()
        stop.wait()

    names = ["mori-shard-0", "mori-shard-1", "not-ours"]
    threads = [threading.Thread(target=work, args=(i,), name=n) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for d in done:
        d.wait()
    live = meter.snapshot()["threads"]
    stop.set()
    for t in threads:
        t.join()
    after = meter.snapshot()["threads"]  # ended: their last reading stays
    assert live["mori-shard-N"] >= 9.5e6 and after["mori-shard-N"] >= live["mori-shard-N"]
    assert "not-ours" not in after


def test_manager_construction_starts_the_snapshot_writer(tmp_path):
    meter = Meter(str(tmp_path / "m"))

    class MoriKVManager:
        def __init__(self):
            self.role = "decode"

    meter.wrap_class(MoriKVManager)
    MoriKVManager()
    snaps = call_meter.wait_fresh(tmp_path / "m", after=0, timeout_s=5)
    (snap,) = snaps.values()
    assert snap["role"] == "decode" and snap["calls"]["MoriKVManager.__init__"][0] == 1


def snap(role, requests, calls, threads):
    return {"role": role, "time": 0, "requests": requests, "calls": calls, "threads": threads}


def test_per_request_sums_calls_and_threads_between_two_snapshots():
    before = {"prefill-1": snap("prefill", 10, {"MoriKVSender.send": [10, 1_000_000]}, {"mori-shard-N": 500_000}),
              "decode-2": snap("decode", 10, {}, {})}
    after = {"prefill-1": snap("prefill", 20, {"MoriKVSender.send": [30, 2_000_000], "MoriKVSender.poll": [100, 500_000]},
                               {"mori-shard-N": 1_500_000, "mori-completion": 200_000, "softio-gpu-0": 300_000}),
             "decode-2": snap("decode", 10, {"MoriKVReceiver.poll": [5, 10]}, {})}
    f = call_meter.per_request(before, after)
    p = f["prefill"]
    assert p["requests"] == 10 and p["scheduler_calls_us"] == 150.0  # (1 ms + 0.5 ms) / 10
    assert p["calls_us"] == {"MoriKVSender.send": 100.0, "MoriKVSender.poll": 50.0}
    assert p["our_threads_us"] == 120.0 and p["engine_threads_us"] == 30.0  # softio apart
    assert p["total_us"] == 270.0 and p["calls_per_request"]["MoriKVSender.poll"] == 10.0
    assert f["decode"] == {"requests": 0, "processes": 1}
    assert call_meter.describe(f).startswith("prefill 270.0 us/req = calls 150.0 (send 100.0, poll 50.0)")


@pytest.mark.parametrize("value, folder", [(None, ""), ("off", ""), ("0", ""), ("/tmp/m", "/tmp/m")])
def test_the_knob_names_a_folder_or_is_off(value, folder):
    env = {} if value is None else {"SGLANG_MORI_CALL_METER": value}
    assert call_meter.folder_from_env(env) == folder


def test_off_leaves_our_sglang_classes_untouched(monkeypatch):
    pytest.importorskip("sglang")
    monkeypatch.delenv("SGLANG_MORI_CALL_METER", raising=False)
    monkeypatch.setattr(call_meter, "_METER", None)
    from sglang_mori import plugin

    classes = plugin.mori_kv_classes()
    for cls in classes.values():
        assert "__sglang_mori_metered__" not in vars(cls)
        assert not any(getattr(v, "__sglang_mori_metered__", False) for v in vars(cls).values())


def test_the_meters_own_clock_reads_are_measured_and_taken_off_each_call(tmp_path):
    meter = Meter(str(tmp_path))
    assert meter.clock_ns > 0 and meter.snapshot()["clock_ns"] == meter.clock_ns
    assert meter.snapshot()["calls"] == {}  # the calibration leaves no call behind
    before = {"p": dict(snap("prefill", 0, {}, {}), clock_ns=700)}
    after = {"p": dict(snap("prefill", 2, {"MoriKVSender.poll": [10, 10 * 700 + 4000], "MoriKVSender.send": [1, 300]}, {}),
                       clock_ns=700)}
    f = call_meter.per_request(before, after)["prefill"]
    assert f["calls_us"] == {"MoriKVSender.poll": 2.0, "MoriKVSender.send": 0.0}  # never below zero


def test_our_code_inside_an_inherited_sglang_call_is_timed_apart_and_not_added_twice(tmp_path):
    """CommonKVSender.send (SGLang's) calls our manager's add_transfer_request: the outer call counts
    once, our part inside it shows as `inner`."""
    meter = Meter(str(tmp_path))
    meter.role = "prefill"

    class Manager:
        __module__ = "sglang_mori.backend.manager"

        def add_transfer_request(self):
            burn(4)

    class CommonSender:  # SGLang's: its send is thin and calls ours
        def send(self):
            burn(1)
            self.mgr.add_transfer_request()

    class MoriKVSender(CommonSender):
        def __init__(self):
            self.mgr = Manager()

    Manager.add_transfer_request.__module__ = "sglang_mori.backend.manager"
    meter.wrap_class(Manager)
    meter.wrap_class(MoriKVSender)
    MoriKVSender().send()
    snap_ = meter.snapshot()
    n, outer, inner_calls = snap_["calls"]["MoriKVSender.send"]
    ni, inner = snap_["inner"]["Manager.add_transfer_request"]
    assert n == 1 and ni == 1 and inner_calls == 1 and 3.5e6 < inner < outer
    assert "Manager.add_transfer_request" not in snap_["calls"]
    # what timing the inner call added to the outer one is measured and taken off the outer only
    assert meter.inner_ns > 0 and snap_["inner_ns"] == meter.inner_ns
    f = call_meter.per_request({}, {"p": dict(snap_, clock_ns=0, inner_ns=1000)})["prefill"]
    assert f["calls_us"]["MoriKVSender.send"] == round((outer - 1000) / 1000, 1)
    assert f["inner_us"]["Manager.add_transfer_request"] == round(inner / 1000, 1)
