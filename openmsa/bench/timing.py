"""GPU timing shared by the benchmarks (GPU only)."""

import torch
import triton.testing

# Each timing runs the function for about WARMUP_MS before it times REPEAT_MS of calls (at least
# one call each; triton.testing.do_bench clears the L2 cache before each timed call). A 60 ms
# call thus gets 8 warmup calls and 16 timed ones: with fewer, the first timing of a new long
# problem read slower than the next ones on the same problem.
WARMUP_MS = 500
REPEAT_MS = 1000


def median_ms(fn) -> float:
    """Median milliseconds per call of ``fn`` (which launches GPU work)."""
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REPEAT_MS, return_mode="median")


def median_ms_read_flushed(fn, reps: int = 200) -> float:
    """Median milliseconds per call of ``fn`` with the L2 cache made cold by reading a 256 MB
    buffer before each call. For calls of microseconds that read a lot: ``median_ms`` makes the
    L2 cold by zero-filling a buffer, whose dirty lines the timed call then writes back (about
    9 us on the H200, whatever the call: benchmarks/records/decode-kernels.json, part cold)."""
    buffer = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    warmups = 10
    events = []
    for rep in range(warmups + reps):
        buffer.sum(dtype=torch.int64)  # reads every line of the buffer
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if rep >= warmups:
            events.append((start, end))
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[reps // 2]


def median_ms_of_few(fn, reps: int = 3) -> float:
    """Median milliseconds of ``reps`` calls after one warm-up call, for calls of a second or
    more (1M-token steps), where ``median_ms`` would spend most of its time estimating."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def captured(fn, warmups: int = 2):
    """``fn`` captured once in a CUDA graph, after ``warmups`` calls on a side stream (they
    compile the kernels): returns the graph and the outputs of the captured call, which each
    replay rewrites in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def graphed(fn):
    """``fn``'s replay from a CUDA graph (``captured``): the same kernels without the host's
    launch and Python costs."""
    return captured(fn)[0].replay


def kernel_profile(fn, calls: int = 1) -> dict:
    """{GPU kernel name: (milliseconds, launches)} per call of ``fn``, the mean over ``calls``
    calls under the torch profiler (after one call that compiles)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for event in profile.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue  # operators: their time is their kernels'
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total > 0:
            kernels[event.key[:60]] = (total / 1000 / calls, event.count / calls)
    return kernels


def kernel_times(fn, top=16):
    """Milliseconds per GPU kernel name for one call of ``fn`` (torch profiler), the ``top``
    longest."""
    times = {name: ms for name, (ms, _) in kernel_profile(fn).items()}
    return dict(sorted(times.items(), key=lambda item: -item[1])[:top])
