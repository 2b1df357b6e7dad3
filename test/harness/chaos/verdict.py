"""What a chaos run counts, from the client's per-request records (bench_client.py): pure logic.

Each request of a fault run ends in exactly one class:

- `completed`: success, and its text is one the standalone server gave for the same prompt ids and
  output length (greedy; bench_serving keeps the text, not the ids: equal ids give equal text);
  the reference is computed in several passes with different batch company, and a prompt to
  which the standalone server itself gave more than one answer is *batch-dependent*: a PD answer
  equal to any of them completes, and is also counted apart (`batch_dependent`), never hidden;
- `mismatch`: success, but a text the standalone server never gave (wrong tokens, or a stream cut
  short): a silent loss;
- `failed`: an error the client saw, within the hang bound; its cause is the error's own words;
- `hung`: no answer within the hang bound (the transfer deadline plus a stated margin), or no
  answer at all before the client was stopped.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

Key = Tuple[Tuple[int, ...], int]  # (prompt token ids, asked output length)
# A prompt's reference: its one text, or every distinct text the standalone server gave it.
Reference = Union[str, Tuple[str, ...]]


@dataclass
class Request:
    i: int
    prompt: Tuple[int, ...]
    output_len: int
    start: float
    end: Optional[float] = None
    success: bool = False
    error: str = ""
    text: str = ""

    @property
    def key(self) -> Key:
        return (self.prompt, self.output_len)

    def elapsed(self, until: float) -> float:
        return (self.end if self.end is not None else until) - self.start


def read_records(path: Path) -> List[Request]:
    """Requests from a bench_client records file; a request without an `end` line never returned.
    A torn last line (the client killed mid-write) is ignored."""
    reqs: Dict[int, Request] = {}
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == "start":
            prompt = rec["prompt"]
            ids = tuple(prompt) if isinstance(prompt, list) else (prompt,)  # a text prompt keys as itself
            reqs[rec["i"]] = Request(rec["i"], ids, int(rec["output_len"]), float(rec["t"]))
        elif rec.get("event") == "end" and rec.get("i") in reqs:
            r = reqs[rec["i"]]
            r.end, r.success, r.error, r.text = float(rec["t"]), bool(rec["success"]), rec["error"], rec["text"]
    return [reqs[i] for i in sorted(reqs)]


def references(reqs: Iterable[Request]) -> Dict[Key, str]:
    """Reference texts from a fault-free run (the standalone server's)."""
    return {r.key: r.text for r in reqs if r.success and r.end is not None}


def merge_references(passes: Sequence[Mapping[Key, str]]) -> Dict[Key, Tuple[str, ...]]:
    """Every distinct answer per prompt over several reference passes (first pass's first)."""
    merged: Dict[Key, Tuple[str, ...]] = {}
    for refs in passes:
        for key, text in refs.items():
            seen = merged.get(key, ())
            merged[key] = seen if text in seen else seen + (text,)
    return merged


def answers(ref: Optional[Reference]) -> Tuple[str, ...]:
    """The texts a reference accepts: none for a missing one."""
    return () if ref is None else (ref,) if isinstance(ref, str) else tuple(ref)


def batch_dependent(refs: Mapping[Key, Reference]) -> Dict[Key, Tuple[str, ...]]:
    """The prompts to which the standalone server gave more than one answer."""
    return {k: answers(v) for k, v in refs.items() if len(answers(v)) > 1}


_NOISE = [
    (re.compile(r"\b\d{6,}\b"), "N"),  # room ids, request ids, ports
    (re.compile(r"0x[0-9a-f]+", re.I), "0x?"),
    (re.compile(r"\b[0-9a-f]{16,}\b", re.I), "ID"),  # request uuids
    (re.compile(r"\d+\.\d+"), "X"),  # timings, addresses
    (re.compile(r"\s+"), " "),
]


def cause(error: str, width: int = 100) -> str:
    """The error's own words, shortened to a comparable cause: the `message` of a JSON error body
    (as SGLang and the router send), else the last line of a traceback; ids and times masked."""
    text = (error or "").strip()
    body = text.split(": ", 1)[1] if ": {" in text[:80] else text  # "<HTTP reason>: <body>"
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict):
            inner = parsed.get("error", parsed)
            text = str(inner.get("message", inner) if isinstance(inner, dict) else inner)
    except (json.JSONDecodeError, TypeError):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        text = lines[-1] if lines else ""
    for pattern, repl in _NOISE:
        text = pattern.sub(repl, text)
    text = text.strip()
    return (text[:width] + "...") if len(text) > width else (text or "(no message)")


# Causes that name nothing: an empty error, or only an HTTP reason phrase without a body.
UNNAMED = {"(no message)", "Internal Server Error:", "Bad Gateway:", "Service Unavailable:", "Gateway Timeout:"}


@dataclass
class Counts:
    requests: int = 0
    completed: int = 0
    mismatch: int = 0
    failed: int = 0
    unnamed: int = 0  # failed without a cause in the error
    hung: int = 0
    no_reference: int = 0
    # completed requests whose prompt the standalone server answered in several ways (included in
    # `completed`), and the most answers such a prompt had
    batch_dependent: int = 0
    batch_dependent_answers: int = 0
    slowest_failure_s: float = 0.0
    causes: Counter = field(default_factory=Counter)
    mismatches: List[str] = field(default_factory=list)


def classify(reqs: Sequence[Request], refs: Mapping[Key, Reference], hang_bound_s: float, until: float) -> Counts:
    """Count every request of a run; `until` is when the client stopped (for unanswered ones)."""
    c = Counts(requests=len(reqs))
    for r in reqs:
        took = r.elapsed(until)
        if r.end is None or took > hang_bound_s:
            c.hung += 1
        elif not r.success:
            c.failed += 1
            c.slowest_failure_s = max(c.slowest_failure_s, took)
            why = cause(r.error)
            c.causes[why] += 1
            c.unnamed += why in UNNAMED
        elif r.key not in refs:
            c.no_reference += 1
        elif r.text in answers(refs[r.key]):
            c.completed += 1
            if len(answers(refs[r.key])) > 1:
                c.batch_dependent += 1
                c.batch_dependent_answers = max(c.batch_dependent_answers, len(answers(refs[r.key])))
        else:
            c.mismatch += 1
            ref = " or ".join(repr(t[:80]) for t in answers(refs[r.key]))
            c.mismatches.append(f"request {r.i} ({len(r.prompt)} prompt tokens, sent at {r.start:.1f}, "
                                f"answered at {r.end:.1f}): {r.text[:80]!r}, reference {ref}")
    return c


def replay_references(url: str, reqs: Sequence[Request], concurrency: int = 8, timeout_s: float = 60.0
                      ) -> Dict[Key, str]:
    """Each distinct prompt of `reqs` sent again to `url` (greedy, ignore_eos, non-streamed, as the
    client sends it): the texts to compare with. For a fault-free deployment (CI's reference)."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    def one(key: Key) -> Tuple[Key, Optional[str]]:
        prompt, out_len = key
        payload = {"input_ids": list(prompt), "sampling_params": {
            "max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}}
        r = requests.post(f"{url}/generate", json=payload, timeout=timeout_s)
        return key, (r.json().get("text") if r.status_code == 200 else None)

    keys = sorted({r.key for r in reqs if all(isinstance(t, int) for t in r.prompt)})
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return {k: text for k, text in pool.map(one, keys) if text is not None}
