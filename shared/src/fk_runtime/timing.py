"""Device time of a call: the one timer the benchmark harness and an op's autotuner share."""

from __future__ import annotations

from collections.abc import Callable

import torch

# do_bench budgets, in milliseconds (its own units), and the fewest timed calls: REP_MS alone
# gives a 16 ms call 6 samples, whose median one slow stretch of the GPU moved by 10% (H100, a
# 16 ms backward of the largest sweep: 16.1 ms in graph replays against 14.4 ms eager, same
# kernels).
WARMUP_MS = 25
REP_MS = 100
MIN_SAMPLES = 25


def do_bench(fn: Callable[[], object], warmup_ms: float = WARMUP_MS, quantiles=None):
    """`triton.testing.do_bench` (median, or `quantiles`) over at least REP_MS and MIN_SAMPLES
    calls. Also an autotuner's timer (same signature as Triton's, for its `do_bench`)."""
    import triton.testing

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    # do_bench fits int(rep / estimate) calls, its estimate including an L2 flush: one call spare.
    rep_ms = max(REP_MS, (MIN_SAMPLES + 1) * start.elapsed_time(end))
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=quantiles,
                                   return_mode="median")
