"""Median time of a piece of device work, for the benchmarks: eager, or as replays of a captured CUDA graph.

A decode server replays its step as a CUDA graph, so graph replays are what a layer's ESS work costs there: eager
timings of many small ops measure Python's launch overhead as well (on an H100 one layer's eager LRU step and H2D
took 1.3 to 3.7 times its graph replay, docs/gpu.md). On the CPU both fall back to the wall clock, in program order.
"""

from __future__ import annotations

import time

import torch


def median_us(fn, iters: int, setup=lambda: None) -> float:
    """Median time of fn() in microseconds over `iters` calls after one untimed warm-up call. setup() runs before
    each call, untimed (e.g. restoring the state fn changes). CUDA events on a GPU, the wall clock on the CPU."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    times = []
    for i in range(iters + 1):
        setup()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            t = start.elapsed_time(end) * 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = (time.perf_counter() - t0) * 1e6
        if i:
            times.append(t)
    times.sort()
    return times[len(times) // 2]


def capture(fn, setup=lambda: None) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after a warm-up run on a side stream (Triton compiles, the allocator settles);
    setup() runs before the warm-up and before the capture."""
    setup()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    setup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn, iters: int, setup=lambda: None) -> float:
    """Median replay time of fn() captured in a CUDA graph (median_us of fn itself where no GPU is in use)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return median_us(fn, iters, setup)
    graph = capture(fn, setup)
    return median_us(graph.replay, iters, setup)
