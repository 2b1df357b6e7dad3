"""Deterministic prompts of varied length for comparing PD and standalone outputs.

Lengths run from a couple of tokens to several times the chunked-prefill size used by the tests (64),
so long prompts are prefilled and sent in several chunks. The text mixes words, digits and punctuation
from the tiny model's training corpus plus some bytes it never saw (accents, symbols).
"""

from __future__ import annotations

import random
from typing import List

_VOCAB = (
    "river mountain city forest engine memory cache prefill decode token batch server router "
    "request transfer page layer kernel tensor signal packet network queue thread worker lane "
    "buffer offset length morning evening winter summer stone glass paper music light runs moves "
    "writes reads sends waits opens closes grows falls turns holds finds keeps under over across "
    "through between before after while because and or but with without the a one two three "
    "café naïve über ★ → ∑ 東京"
).split()

# Word counts per prompt: short, medium, around one chunk, and several chunks long.
_LENGTHS = [1, 2, 3, 5, 8, 12, 16, 20, 25, 30, 40, 48, 56, 64, 80, 96, 120, 150, 180, 220, 260,
            300, 10, 70]


def varied_prompts(count: int = 24, seed: int = 7) -> List[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = _LENGTHS[i % len(_LENGTHS)] + rng.randint(0, 3)
        parts = []
        for _ in range(words):
            word = rng.choice(_VOCAB)
            if rng.random() < 0.1:
                word = str(rng.randint(0, 99999))
            parts.append(word)
            if rng.random() < 0.08:
                parts[-1] += rng.choice([",", ".", ";", "!", "?"])
        prompts.append(f"[{i}] " + " ".join(parts))
    return prompts
