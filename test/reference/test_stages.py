"""Staged layers (ess.reference.stages): drained alone, interleaved as two-batch overlap orders two micro-batches."""

from ess.reference.stages import drain, interleave


def staged(name: str, n: int, log: list):
    for i in range(n):
        log.append(f"{name}{i}")
        yield
    log.append(f"{name}{n}")
    return name


def test_drain_runs_every_stage_and_returns():
    log = []
    assert drain(staged("a", 2, log)) == "a" and log == ["a0", "a1", "a2"]


def test_micro_batch_a_runs_two_stages_ahead_of_b():
    """SGLang's two-batch overlap of a decode layer: A's first two stages, then A's and B's next in turn, so each
    transfer A launches (its dispatch, its combine, its H2D) runs beside B's compute; both run to their ends, uneven
    lengths too."""
    log = []
    assert interleave(staged("a", 3, log), staged("b", 3, log)) == ("a", "b")
    assert log == ["a0", "a1", "a2", "b0", "a3", "b1", "b2", "b3"]
    log.clear()
    interleave(staged("a", 1, log), staged("b", 2, log), delta=0)
    assert log == ["a0", "b0", "a1", "b1", "b2"]
