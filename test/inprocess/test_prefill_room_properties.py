"""Property test of the prefill room registry and its one applier (rooms.py, effects.py).

Hypothesis drives random event sequences through the real service code (claim, decode's metadata
and its replays, chunk submission, writes turning terminal, decode's abort, SGLang's own abort, a
peer failure, a deadline, retract-rebootstrap) with fake writes, a fake clock and FakeSGLang's
tables, and the completion thread's pass after each event. After every step:

- SGLang's view of each room a sender holds equals the registry's (status and outstanding count;
  while a completion pass is held, the count may lag above: that pass publishes what ended);
- every in-flight budget slot is returned at most once, and once the writes are over, exactly once;
- a room that concluded never changes its outcome or reason, and phases only move forward;
- Success is concluded only while every write of the life succeeded, its last chunk is tracked
  and no submitter holds a token on it.
- a room's chunks handed over through `enqueue` with inline posts on (SGLANG_MORI_INLINE_POST,
  `hand_over`: posted on the handing-over thread, handed off to the shard, or queued) are posted
  in the order they were handed over.

The completion pass also runs split in two (`completion_reads`, `completion_decides`): held on a
thread right after its verdict, while submitter steps (`begin_submit`, `end_submit` with or
without the last chunk, writes) and the other events run, then let go to decide.
"""

import threading
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.peers import InflightBudget
from sglang_mori.backend.prefill.failures import ABORTED, ABORTED_ON_PREFILL
from sglang_mori.backend.prefill.rooms import Phase, PrefillRoomRegistry, RoomTarget, TrackedWrite
from sglang_mori.backend.prefill.service import PrefillService
from sglang_mori.backend.prefill.submitter import HAND_OFF, Chunk, ChunkSubmitter
from sglang_mori.config import MoriConfig
from sglang_mori.engine import FailureKind, WriteState

from fake_sglang import FakeSGLang

ROOMS = (1, 2, 3)
PEERS = ("decode-a", "decode-b")
TIMEOUT_S = 5.0
ORDER = {Phase.AWAITING_METADATA: 0, Phase.READY: 1, Phase.SUBMITTING: 2, Phase.CONCLUDED: 3,
         Phase.DRAINED: 4, Phase.POISONED: 4}


class FakeWrite:
    """An engine handle whose state the test sets; `nbytes` is unique and names it in metrics."""

    def __init__(self, peer_key: str, serial: int, started_at: float):
        self.peer_key, self.nbytes, self.started_at = peer_key, serial, started_at
        self.released, self.retries, self.fenced = False, 0, False
        self._state, self._drained = WriteState.RUNNING, False

    def finish(self, outcome: str) -> None:
        if self._state is WriteState.RUNNING:
            self._state = WriteState.SUCCEEDED if outcome == "ok" else WriteState.FAILED
            self._drained = outcome != "failed_landing"

    def state(self):
        return self._state

    def quiescent(self) -> bool:
        return self._state is not WriteState.RUNNING

    def drained(self) -> bool:
        return self.quiescent() and self._drained

    def failure_kind(self):
        return FailureKind.TIMED_OUT if self._state is WriteState.RUNNING else FailureKind.TRANSPORT

    def failure_message(self) -> str:
        return "fake failure"

    def wait_running(self, timeout_ms):
        return False


class CountingBudget(InflightBudget):
    def __init__(self):
        super().__init__(1 << 20)
        self.taken = self.returned = 0

    def acquire(self, key, deadline, nbytes=0, abandoned=None):
        self.taken += 1
        return super().acquire(key, deadline, nbytes, abandoned)

    def release(self, key, count=1, nbytes=0):
        assert self.count(key) >= count, f"budget of {key} returned more often than taken"
        self.returned += count
        super().release(key, count, nbytes)


class Recorder:
    """Metrics and messenger: what the applier did."""

    def __init__(self):
        self.finished_writes: dict = {}  # nbytes (the write's id) -> times counted
        self.requests: list = []
        self.sent: list = []

    def transfer_finished(self, peer, nbytes, seconds, ok, reason=None):
        self.finished_writes[nbytes] = self.finished_writes.get(nbytes, 0) + 1

    def request_finished(self, ok, reason=None):
        self.requests.append((ok, reason))

    def send_all(self, addresses, message):
        self.sent.extend((a, message) for a in addresses)

    def send(self, address, message, block=True):
        self.sent.append((address, message))

    def __getattr__(self, name):  # every other metric
        return lambda *a, **k: None


class FakeSubmitter(ChunkSubmitter):
    """The real submit path (begin_submit, post_tracked, end_submit, the failure door) with a
    post step that takes a budget slot per write and issues fake writes."""

    def __init__(self, machine, *args):
        super().__init__(*args)
        self.machine = machine

    def post(self, chunk, targets, writes, life=None, defer_held=False, announce=None, inline=False):
        if inline and self.machine.hand_off:
            return HAND_OFF  # something would wait (a session to open, a full budget): nothing posted
        # Announces nothing itself: a last chunk's TransferStarted stays due in `announce` and is
        # held back by post_tracked as the real post's is (announce.py); earlier chunks' are not sent.
        if announce is not None and not chunk.is_last:
            announce[0] = False
        seq = getattr(chunk, "seq", None)
        if seq is not None:  # handed over through `enqueue` (inline or queued): posting order
            self.machine.posted.append((id(life), seq))
        for t in targets:  # never held (the budget is far above the load): nothing to defer
            for _ in range(chunk.num_kv_tokens):
                assert self.effects.take_slot(t.engine_key, self.p.clock() + TIMEOUT_S)
                w = self.machine.new_write(t.engine_key)
                writes.append(TrackedWrite(w, self.p.clock() + TIMEOUT_S))
        return None


class SplitPass:
    """One completion pass over `life` on its own thread, held right after its first verdict taken
    outside the registry lock (its reads; a verdict under the lock is a locked re-check and is
    never held) until `decide()`. A pass that takes no verdict (the life concluded, or SGLang
    failed it) runs to its end at once."""

    WAIT_S = 30.0

    def __init__(self, completion, lock, life, now):
        self.life, self.error = life, None
        self.read, self.go = threading.Event(), threading.Event()
        verdict = life.verdict

        def held_verdict(at):
            out = verdict(at)
            if not self.read.is_set() and not lock.locked():
                self.read.set()
                self.go.wait(self.WAIT_S)
            return out

        life.verdict = held_verdict
        self.thread = threading.Thread(target=self._run, args=(completion, now), daemon=True)
        self.thread.start()
        assert self.read.wait(self.WAIT_S), "the completion pass neither read nor ended"

    def _run(self, completion, now):
        try:
            completion.advance(self.life, now)
        except BaseException as exc:  # re-raised by decide()
            self.error = exc
        finally:
            self.read.set()

    def decide(self):
        self.go.set()
        self.thread.join(self.WAIT_S)
        assert not self.thread.is_alive(), "the completion pass did not finish"
        del self.life.verdict
        if self.error is not None:
            raise self.error


class RoomMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.now = 100.0
        self.sglang = FakeSGLang()
        self.budget = CountingBudget()
        self.rec = Recorder()
        self.parts = SimpleNamespace(
            config=MoriConfig(inline_post="off"), rooms=PrefillRoomRegistry(), sglang=self.sglang, metrics=self.rec,
            messenger=self.rec, peers=SimpleNamespace(budget=self.budget, mark_failed=lambda *a: False),
            clock=lambda: self.now, timeout_s=TIMEOUT_S, owns_aux=False, read_aux=lambda i: None,
            engine=SimpleNamespace(pop_peer_failures=lambda: [], can_fence=False))
        self.service = PrefillService(self.parts, reject=lambda *a: None)
        self.submitter = FakeSubmitter(self, self.parts, self.service.effects, self.service.failures,
                                       self.service.success)
        self.senders: set = set()  # room ids SGLang holds a sender for
        self.writes: list = []
        self.attempts = 0
        self.served: list = []  # (room, engine key, attempt) metadata sent
        self.concluded: dict = {}  # id(life) -> (life, outcome, reason)
        self.phases: dict = {}  # id(life) -> (life, last phase seen)
        self.split = None  # a completion pass held between its reads and its decision
        self.tokens: list = []  # (life, targets): submit tokens the split submitter steps hold
        self.successes: list = []  # (room, write states, submit tokens, last chunk) as Success concluded
        # SGLANG_MORI_INLINE_POST=on (`hand_over`): chunks handed over through `enqueue`, posted on
        # this thread or queued for their shard (no shard threads run: `shard_takes` drains).
        self.hand_off = False  # the next inline post finds something that would wait
        self.seq = 0
        self.posted: list = []  # (id(life), seq) of each chunk handed over through `enqueue`, as posted
        succeed = self.parts.rooms.succeed

        def recorded_succeed(r, *args):
            # Under the registry lock: the room exactly as the Success transition saw it.
            done = succeed(r, *args)
            if done:
                self.successes.append((r.room, [w.handle.state() for w in r.writes], r.submitting,
                                       r.last_submitted))
            return done

        self.parts.rooms.succeed = recorded_succeed

    def new_write(self, peer: str) -> FakeWrite:
        w = FakeWrite(peer, len(self.writes) + 1, self.now)
        self.writes.append(w)
        return w

    def lives(self) -> list:
        reg = self.parts.rooms
        return list(reg.rooms.values()) + list(reg.draining.values())

    # --- events -------------------------------------------------------------------------------
    @rule(room=st.sampled_from(ROOMS))
    def claim(self, room):
        if room in self.senders:
            return  # SGLang never holds two senders for one room id
        self.senders.add(room)
        self.sglang.open(room)
        self.service.claim(room)

    @rule(room=st.sampled_from(ROOMS), peer=st.sampled_from(PEERS), required=st.integers(1, 2))
    def metadata(self, room, peer, required):
        self.attempts += 1
        self._metadata(room, peer, self.attempts, required)

    @precondition(lambda self: self.served)
    @rule(data=st.data())
    def replay(self, data):
        room, peer, attempt = data.draw(st.sampled_from(self.served))
        self._metadata(room, peer, attempt, 1)

    def _metadata(self, room, peer, attempt, required):
        self.served.append((room, peer, attempt))
        target = RoomTarget(engine_key=peer, attempt=attempt, endpoint="127.0.0.1", dst_port=17000 + PEERS.index(peer),
                            kv_indices=np.arange(4), aux_index=0, state_indices=None, required_dst_info_num=required,
                            decode_prefix_len=None, is_dummy=False)
        with self.service.effects.transition() as fx:
            self.parts.rooms.add_target(target, room, self.now, fx)

    @rule(room=st.sampled_from(ROOMS), writes=st.integers(0, 2), last=st.booleans())
    def submit(self, room, writes, last):
        self.submitter.submit(Chunk(room=room, kv_indices=np.arange(4), index_slice=slice(0, 4), is_last=last,
                                    aux_index=0, state_indices=None, num_kv_tokens=writes))

    @rule(room=st.sampled_from(ROOMS), writes=st.integers(1, 3), last=st.booleans(), landed=st.booleans())
    def serve(self, room, writes, last, landed):
        """The usual life: a sender, decode's metadata, a chunk (whichever are missing first);
        `landed`: its writes succeed before the completion thread looks (a fast GPU copy)."""
        self.claim(room)
        with self.parts.rooms.lock:
            waiting = self.parts.rooms.get(room).phase is Phase.AWAITING_METADATA
        if waiting:
            self.metadata(room, PEERS[room % 2], 1)
        issued = len(self.writes)
        self.submit(room, writes, last)
        if landed:
            for w in self.writes[issued:]:
                w.finish("ok")

    # --- SGLang's send(): `enqueue`, with inline posts (SGLANG_MORI_INLINE_POST=on) ------------------
    @rule(room=st.sampled_from(ROOMS), writes=st.integers(0, 2), last=st.booleans(), hand_off=st.booleans(),
          chunks=st.integers(1, 2))
    def hand_over(self, room, writes, last, hand_off, chunks):
        """Chunks handed over as SGLang's scheduler does: each posted inline when its room and shard
        are idle, else queued for its shard; `hand_off`: the first one's inline post finds
        something that would wait (post returns HAND_OFF before posting anything), so it is queued
        and the next one (`chunks` 2) finds its room with a chunk queued. The room is served first
        (a sender, decode's metadata), as in `serve`: most chunks find a live room."""
        self.claim(room)
        with self.parts.rooms.lock:
            waiting = self.parts.rooms.get(room).phase is Phase.AWAITING_METADATA
        if waiting:
            self.metadata(room, PEERS[room % 2], 1)
        self.submitter.inline_post = True
        for i in range(chunks):
            self.seq += 1
            chunk = Chunk(room=room, kv_indices=np.arange(4), index_slice=slice(0, 4), is_last=last and i == chunks - 1,
                          aux_index=0, state_indices=None, num_kv_tokens=writes)
            chunk.seq = self.seq
            self.hand_off = hand_off and i == 0
            try:
                self.submitter.enqueue(chunk)
            finally:
                self.hand_off = False

    @precondition(lambda self: self.submitter.queued())
    @rule(data=st.data())
    def shard_takes(self, data):
        """A shard takes the oldest chunk of its queue and submits it (run_shard)."""
        q = data.draw(st.sampled_from([q for q in self.submitter.queues if q.qsize()]))
        self.submitter.submit(q.get(), defer_held=True)

    # --- a submitter in steps: its token, then its writes tracked ---------------------------------
    @rule(room=st.sampled_from(ROOMS))
    def begin_submit(self, room):
        with self.service.effects.transition() as fx:
            life = self.parts.rooms.get(room)
            if life is None or life.concluded or not self.parts.rooms.begin_submit(life, fx):
                return
            targets = life.live_targets()
        self.tokens.append((life, targets))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), writes=st.integers(0, 2), last=st.booleans())
    def end_submit(self, data, writes, last):
        life, targets = self.tokens.pop(data.draw(st.integers(0, len(self.tokens) - 1)))
        self._end_submit(life, targets, writes, last)

    def _end_submit(self, life, targets, writes, last):
        tracked = []
        for t in targets:
            for _ in range(writes):
                assert self.service.effects.take_slot(t.engine_key, self.now + TIMEOUT_S)
                tracked.append(TrackedWrite(self.new_write(t.engine_key), self.now + TIMEOUT_S))
        with self.service.effects.transition() as fx:
            self.parts.rooms.end_submit(life, tracked, last, 0, fx)

    # --- the completion pass, split -------------------------------------------------------------
    def _watched(self) -> list:
        with self.parts.rooms.lock:
            return [r for r in self.parts.rooms.with_writes() if not r.concluded]

    @precondition(lambda self: self.split is None and self._watched())
    @rule(data=st.data())
    def completion_reads(self, data):
        life = data.draw(st.sampled_from(self._watched()))
        self.split = SplitPass(self.service.completion, self.parts.rooms.lock, life, self.now)

    @precondition(lambda self: self.split is not None)
    @rule()
    def completion_decides(self):
        split, self.split = self.split, None
        split.decide()

    @precondition(lambda self: self.split is None and self._watched())
    @rule(data=st.data(), landed_before=st.booleans(),
          steps=st.lists(st.sampled_from(["chunk", "last_chunk", "token", "landed"]), min_size=1, max_size=3))
    def completion_pass_around_submitter_steps(self, data, landed_before, steps):
        """The same split, with the submitter working on the held pass's room in between: chunks
        (the last one too), a token of the split submitter given back with writes, writes landing.
        `landed_before`: every write so far landed before the pass read (its verdict is Success)."""
        if landed_before:
            self.writes_succeed()
        self.completion_reads(data)
        room = self.split.life.room
        for step in steps:
            if step == "landed":
                self.writes_succeed()
            elif step == "token" and self.tokens:
                self.end_submit(data, data.draw(st.integers(1, 2)), data.draw(st.booleans()))
            else:
                self.submit(room, data.draw(st.integers(1, 2)), step == "last_chunk")
        self.completion_decides()

    @precondition(lambda self: any(w.state() is WriteState.RUNNING for w in self.writes))
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "ok", "failed_drained", "failed_landing"]))
    def write_terminal(self, data, outcome):
        running = [w for w in self.writes if w.state() is WriteState.RUNNING]
        data.draw(st.sampled_from(running)).finish(outcome)

    @rule()
    def writes_succeed(self):
        for w in self.writes:
            w.finish("ok")

    @rule(room=st.sampled_from(ROOMS))
    def decode_abort(self, room):
        with self.parts.rooms.lock:
            life = self.parts.rooms.get(room)
            attempts = sorted(life.attempts()) if life is not None and life.targets else [0]
        self.service.control.on_abort(protocol.Abort(room=room, attempt=attempts[0], decode_ip="127.0.0.1",
                                                     decode_port=17000, generation=7))

    @rule(room=st.sampled_from(ROOMS))
    def sglang_abort(self, room):
        with self.parts.rooms.lock:
            life = self.parts.rooms.get(room)
        if room not in self.senders or life.succeeded:
            return  # the scheduler aborts requests in flight; after Success their sender is done
        self.sglang.fail(room, "Aborted by AbortReq.")  # what CommonKVSender.abort() does
        self.service.fail(room, ABORTED_ON_PREFILL, ABORTED)  # then our sender's abort

    @rule(peer=st.sampled_from(PEERS))
    def peer_failure(self, peer):
        self.service.control.fail_rooms_of_peer(peer, f"decode engine {peer} failed")

    @rule()
    def deadline(self):
        self.now += TIMEOUT_S + 1

    @rule()
    def announce_grace_passes(self):
        self.now += 2 * self.parts.config.announce_grace_ms / 1000.0

    @rule(room=st.sampled_from(ROOMS))
    def retract(self, room):
        if room not in self.senders:
            return
        self.senders.discard(room)
        self.sglang.clear(room)
        self.service.release(room)

    # --- the completion thread's pass, then the invariants --------------------------------------
    def _complete(self):
        if self.split is not None:
            return  # one completion thread: its held pass decides first
        with self.parts.rooms.lock:
            rooms = self.parts.rooms.with_writes()
        for r in rooms:
            self.service.completion.advance(r, self.now)

    @invariant()
    def sglang_view_equals_the_registry(self):
        self._complete()
        reg = self.parts.rooms
        for room in self.senders:
            life = reg.get(room)
            assert life is not None and life.claimed, room
            status = self.sglang.status(room)
            if life.failed:
                assert status == S.FAILED, (room, life.phase, status)
                assert self.sglang.failure_records.get(room), room
            elif life.succeeded:
                assert status == S.SUCCESS, (room, life.phase, status)
            else:
                expected = {Phase.AWAITING_METADATA: S.BOOTSTRAPPING, Phase.READY: S.WAITING_FOR_INPUT,
                            Phase.SUBMITTING: S.TRANSFERRING}[life.phase]
                assert status == expected, (room, life.phase, status)
            if life.terminal:
                assert room not in self.sglang.outstanding, (room, life.phase)
            elif self.split is not None:
                # Writes that ended since the held pass began are published when it settles them.
                assert self.sglang.outstanding.get(room, 0) >= life.outstanding(), (room, life.phase)
            else:
                assert self.sglang.outstanding.get(room, 0) == life.outstanding(), (room, life.phase)

    @invariant()
    def no_transfer_started_after_its_rooms_status(self):
        concluded = set()  # (address, room, attempt) told its terminal status
        for address, message in self.rec.sent:
            key = (tuple(address), message.room, getattr(message, "attempt", None))
            if isinstance(message, protocol.RoomStatus):
                concluded.add(key)
            elif isinstance(message, protocol.TransferStarted):
                assert key not in concluded, key

    @invariant()
    def a_rooms_chunks_are_posted_in_the_order_handed_over(self):
        last = {}
        for life, seq in self.posted:
            assert seq > last.get(life, 0), (life, seq, last.get(life))
            last[life] = seq

    @invariant()
    def budget_slots_return_at_most_once(self):
        assert all(n == 1 for n in self.rec.finished_writes.values()), self.rec.finished_writes
        released = [w for w in self.writes if w.released]
        assert set(self.rec.finished_writes) == {w.nbytes for w in released}
        assert self.budget.taken == len(self.writes)
        assert self.budget.returned == len(released)
        assert self.budget.total() == len(self.writes) - len(released)

    @invariant()
    def concluded_rooms_never_change(self):
        for life in self.lives():
            seen = self.phases.get(id(life))
            if seen is not None:
                assert ORDER[life.phase] >= ORDER[seen[1]], (life.room, seen[1], life.phase)
            self.phases[id(life)] = (life, life.phase)
            if life.concluded:
                first = self.concluded.setdefault(id(life), (life, life.outcome, life.reason))
                assert (life.outcome, life.reason) == first[1:], (life.room, first[1:], life.outcome, life.reason)
        for life, outcome, reason in self.concluded.values():
            assert life.concluded and (life.outcome, life.reason) == (outcome, reason)

    @invariant()
    def success_only_over_succeeded_writes_and_no_submitter(self):
        for room, states, tokens, last in self.successes:
            assert last and tokens == 0 and all(st is WriteState.SUCCEEDED for st in states), (
                room, states, tokens, last)

    def teardown(self):
        if self.split is not None:
            self.completion_decides()
        for q in self.submitter.queues:  # the shards take what is queued
            while q.qsize():
                self.submitter.submit(q.get(), defer_held=True)
        self.a_rooms_chunks_are_posted_in_the_order_handed_over()
        while self.tokens:  # the submitters finish: their tokens come back
            self._end_submit(*self.tokens.pop(), 0, False)
        # Half the writes end, the others never do; time passes (their rooms time out, then are
        # given up on): every slot is back, each once.
        for w in self.writes[::2]:
            w.finish("ok")
        for _ in range(2):
            self.now += 100 * TIMEOUT_S
            self._complete()
        assert all(w.released for w in self.writes), "a write kept its budget slot"
        assert self.budget.total() == 0 and self.budget.returned == len(self.writes)
        assert all(n == 1 for n in self.rec.finished_writes.values())


RoomMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_prefill_rooms_under_random_events = RoomMachine.TestCase
