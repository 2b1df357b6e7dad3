"""Function calls (Python and C, as the profiler hook sees them) in each of SGLang's calls into
decode on its step thread, counted while the hot-path rig runs (`bench hotpath --engine instant
--decode-polls`): a measure of our Python per message and per request that a shared CPU host's
noise does not move (issue 28, session 22). Per request (medians over the measured requests):

- `decode.poll/message`: a poll whose look read at least one message (byte set -> receive ->
  decode -> room lookup -> status/aux applied -> SGLang's status), per message read;
- `decode.poll/empty`: a poll that read nothing;
- `decode.init`, `decode.send_metadata`, `decode.clear`: the receiver's other calls into us.

With --names, the functions called inside each (calls per message, or per request).

    SGLANG_MORI_DECODE_ARRIVAL_FLAG=process scripts/in_private_netns.sh .venv/bin/python \
        test/manual/decode_calls_cpu.py [REQUESTS] [--names]

PYTHONPATH=<checkout>/python counts another checkout's backend (the harness is this one's).
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
import threading
from pathlib import Path

TEST = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TEST / "harness"), str(TEST)]

from harness.hotpath import run as hot  # noqa: E402
from harness.hotpath.meter import CallMeter  # noqa: E402

counts = collections.defaultdict(list)  # call name -> calls counted, one entry per call
names = collections.defaultdict(collections.Counter)  # call name -> function -> calls
message_looks = [0]
mine = threading.local()  # .n: calls counted on this thread so far (None: not counting)


def _hook(frame, event, arg):
    n = getattr(mine, "n", None)
    if n is None or event not in ("call", "c_call"):
        return
    mine.n = n + 1
    if mine.names is not None:
        if event == "call":
            code = frame.f_code
            mine.names[f"{Path(code.co_filename).stem}.{code.co_qualname}"] += 1
        else:
            mine.names[f"C {getattr(arg, '__qualname__', arg)}"] += 1


def _install() -> None:
    original = CallMeter.call

    @contextlib.contextmanager
    def counted_call(self, name: str):
        if not self.enabled:
            with original(self, name):
                yield
            return
        inbox = _inbox[0]
        before = inbox.by_poller if inbox is not None else 0
        mine.n, mine.names = 0, collections.Counter()
        try:
            with original(self, name):
                yield
        finally:
            n, seen = mine.n, mine.names
            mine.n = mine.names = None
            if name == "decode.poll":
                read = (inbox.by_poller - before) if inbox is not None else 0
                if read:
                    counts["decode.poll/message"].append(n / read)
                    names["decode.poll/message"].update(seen)
                    message_looks[0] += read
                else:
                    counts["decode.poll/empty"].append(n)
            else:
                counts[name].append(n)
                names[name].update(seen)

    CallMeter.call = counted_call
    start = hot.PDPair.start

    def start_and_note(pair):
        out = start(pair)
        _inbox[0] = pair.decode.inbox
        return out

    hot.PDPair.start = start_and_note
    sys.setprofile(_hook)


_inbox = [None]


def main(requests: int = 96, show_names: bool = False) -> None:
    _install()
    result = hot.run_case("mla61p64", 1024, requests, 8, 16, config=hot.rig_config(transfer_shards=1),
                          engine_mode="instant", decode_polls=True)
    print(f"arrival flag: {result.get('decode_arrival_flag')}; messages/req {result['decode_messages_per_request']}; "
          f"polls/req {result.get('decode_polls_per_request')}; poll looks/req "
          f"{result.get('decode_poll_looks_per_request')}; read by {result.get('decode_read_by')}")
    for key in ("decode.poll/message", "decode.poll/empty", "decode.init", "decode.send_metadata", "decode.clear"):
        v = counts.get(key)
        if v:
            print(f"{key}: median {statistics.median(v):.0f} calls (min {min(v):.0f}, max {max(v):.0f}, "
                  f"{len(v)} counted)", flush=True)
    for key, per in (("decode.poll/message", message_looks[0]), ("decode.init", requests),
                     ("decode.send_metadata", requests), ("decode.clear", requests)):
        if show_names and per and key in names:
            print(f"inside {key}, calls per {'message' if key.startswith('decode.poll') else 'request'}:")
            for name, n in names[key].most_common(40):
                print(f"  {n / per:6.2f}  {name}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(int(args[0]) if args else 96, "--names" in sys.argv)
