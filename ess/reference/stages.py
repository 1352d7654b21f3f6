"""Staged layers: a layer written as a generator yields where two-batch overlap lets the other micro-batch run
(docs/gpu.md, "Two-batch overlap") and returns its result; run alone, it is drained."""

from __future__ import annotations


def drain(stages):
    """Run a staged generator to its end; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


# micro-batch A's lead in stages: SGLang 0.5.23's two-batch overlap of a DeepSeek decode layer
# (`tbo_delta_stages` of its decode strategy, five stages a layer: docs/gpu.md, "Two-batch overlap")
DELTA_STAGES = 2


def interleave(a, b, delta: int = DELTA_STAGES) -> tuple:
    """Two micro-batches' staged generators as two-batch overlap runs them: a's first `delta` stages, then in each
    round a's next stage and b's (b `delta` stages behind), each to its end; their return values."""
    gens, alive, results = [a, b], [True, True], [None, None]

    def advance(i: int) -> None:
        if alive[i]:
            try:
                next(gens[i])
            except StopIteration as done:
                alive[i], results[i] = False, done.value

    for _ in range(delta):
        advance(0)
    while any(alive):
        advance(0)
        advance(1)
    return tuple(results)
