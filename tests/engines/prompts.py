"""The requests engine tests send: token-id prompts, each with its own output length."""

from __future__ import annotations

import dataclasses
import random


# Two prompts end in this id: their outputs differ only if the model reads the KV of
# the rest of the prompt.
SAME_LAST_ID = 500


@dataclasses.dataclass(frozen=True)
class Request:
    input_ids: tuple[int, ...]
    max_new_tokens: int


def standard_waves(seed: int = 0) -> list[list[Request]]:
    """Ten requests in two waves, each wave sent at once. Prompts of 5 to 257
    tokens, most longer than a chunked-prefill step (64) so the prefill sends KV in
    chunks, some not page-aligned; two share a 96-token prefix in the first wave;
    the second wave extends a first-wave prompt and reuses the shared prefix, so a
    radix cache holds part of them. Two prompts end in the same id
    (`prompt_dependence`)."""
    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 1024) for _ in range(n))

    shared = ids(96)
    first = [
        Request(ids(5), 8),
        Request(ids(16) + (SAME_LAST_ID,), 6),
        Request(ids(64), 10),
        Request(ids(99) + (SAME_LAST_ID,), 7),
        Request(ids(257), 9),
        Request(shared + ids(40), 8),
        Request(shared + ids(71), 5),
        Request(ids(150), 12),
    ]
    second = [
        Request(first[4].input_ids + ids(30), 8),
        Request(shared + ids(23), 6),
    ]
    return [first, second]


def prompt_dependence(waves, tokens) -> list[tuple[Request, list[int], Request, list[int]]]:
    """Pairs of different prompts that end in the same id, with their generated ids
    (``tokens`` indexed like ``waves``). A model whose outputs are equal for such a
    pair ignores all but the last token, and a KV transfer checked with it proves
    nothing (`model.py`)."""
    flat = [(r, t) for wave, outs in zip(waves, tokens) for r, t in zip(wave, outs)]
    return [
        (a, ta, b, tb)
        for i, (a, ta) in enumerate(flat)
        for b, tb in flat[i + 1:]
        if a.input_ids[-1] == b.input_ids[-1] and a.input_ids != b.input_ids
    ]
