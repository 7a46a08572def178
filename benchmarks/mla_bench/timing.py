"""Timers, CUDA-graph capture and the copy-bandwidth / matmul ceilings the results are measured against.

The timer is triton.testing.do_bench when Triton is installed, else an equivalent CUDA-event loop that
flushes L2 before each timed call. Times are in µs (median and the 20th / 80th percentiles).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional, Sequence

import torch

from .shapes import Work

FLUSH_BYTES = 256 * 1024 * 1024       # L2 flush buffer of the CUDA-event timer (as do_bench)
COPY_CEILING_BYTES = 1 << 30          # bytes read by the copy ceiling (the same number is written)
MATMUL_CEILING_N = 8192


@dataclasses.dataclass(frozen=True)
class Ceilings:
    copy_gbs: float        # device copy, (bytes read + bytes written) / s / 1e9
    matmul_tflops: float   # n^3 matmul in the benchmark dtype
    copy_bytes: int
    matmul_n: int
    dtype: str

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the two ceilings meet."""
        return self.matmul_tflops * 1e12 / (self.copy_gbs * 1e9)


def derive_metrics(work: Work, median_us: float, ceilings: Optional[Ceilings]) -> dict:
    s = median_us * 1e-6
    tflops = work.flops / s / 1e12
    gbs = work.bytes / s / 1e9
    m = {"tflops": tflops, "gbs": gbs, "frac_flops": None, "frac_bw": None,
         "bound": None, "frac_ceiling": None, "roofline_us": None}
    if ceilings is not None:
        m["frac_flops"] = tflops / ceilings.matmul_tflops
        m["frac_bw"] = gbs / ceilings.copy_gbs
        m["bound"] = "compute" if work.intensity >= ceilings.ridge else "memory"
        m["frac_ceiling"] = m["frac_flops"] if m["bound"] == "compute" else m["frac_bw"]
        floor_s = max(work.flops / (ceilings.matmul_tflops * 1e12), work.bytes / (ceilings.copy_gbs * 1e9))
        m["roofline_us"] = floor_s * 1e6
    return m


@dataclasses.dataclass
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    method: str
    power: Optional[dict] = None   # mla_bench.power.Reading.as_dict() of the timing's window, with --power


Timer = Callable[[Callable[[], Any], float, float], Timing]


def time_with_do_bench(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> Timing:
    import triton.testing
    q = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    med, p20, p80 = (float(x) * 1e3 for x in q)
    return Timing(med, p20, p80, "triton.testing.do_bench")


def time_with_events(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> Timing:
    """Like do_bench: flush L2 before each timed call, one event pair per call, quantiles."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    n = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=torch.float64)
    med, p20, p80 = (float(torch.quantile(times, q)) * 1e3 for q in (0.5, 0.2, 0.8))
    return Timing(med, p20, p80, "cuda events")


TIMER_NAMES = {"time_with_do_bench": "triton.testing.do_bench median", "time_with_events": "CUDA events median"}


def with_power(timer: Timer, monitor: Any) -> Timer:
    """The timer, each of its calls in one window of `monitor` (mla_bench.power.PowerMonitor): the Timing carries the
    window's power and SM clock."""
    def timed(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> Timing:
        with monitor.window() as reading:
            t = timer(fn, warmup_ms, rep_ms)
        return dataclasses.replace(t, power=reading.as_dict())
    timed.__name__ = timer.__name__
    return timed


def pick_timer() -> Timer:
    try:
        import triton.testing
    except ImportError:
        return time_with_events
    return time_with_do_bench if hasattr(triton.testing, "do_bench") else time_with_events


def rotating(calls: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """One call per invocation, cycling through the input copies."""
    it = itertools.cycle(calls)
    return lambda: next(it)()


def graph_replay_us(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, power: Any = None,
                    back_to_back: bool = False) -> tuple[float, Any]:
    """fn captured in one CUDA graph (after an eager call and one on a side stream), its replays timed with
    triton.testing.do_bench: (median in µs, what the captured call returned: the graph's output tensors, which
    every replay rewrites). The FP8 kernel scripts (fp8_kernel_sweep.py, fp8_split_error.py) time each call so.
    power: a mla_bench.power.PowerMonitor; the timing then runs in one of its windows, kept as power.last.
    back_to_back: instead of do_bench (which clears the L2 cache between calls and takes the median), replay the
    graph without pause for rep_ms (after warmup_ms of the same) and return the mean time a call: the load a
    serving engine puts on the GPU, at the clock the board holds under it."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            res = fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if back_to_back:
        return _back_to_back_us(graph.replay, warmup_ms, rep_ms, power), res
    if power is None:
        ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    else:
        with power.window():
            ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return ms * 1e3, res


def _back_to_back_us(replay: Callable[[], Any], warmup_ms: float, rep_ms: float, power: Any = None) -> float:
    """Mean µs a call of `replay` launched back to back for about rep_ms, after about warmup_ms of the same (CUDA
    events around the launches: a call shorter than a graph launch on the host, a few µs, is timed with the gaps)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(n: int) -> float:
        start.record()
        for _ in range(n):
            replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    per_call_ms = run(5) / 5
    run(max(1, int(warmup_ms / per_call_ms)))
    n = max(10, int(rep_ms / per_call_ms))
    if power is None:
        return run(n) / n * 1e3
    with power.window():
        ms = run(n)
    return ms / n * 1e3


def capture_graphs(calls: Sequence[Callable[[], Any]]) -> list[Callable[[], Any]]:
    """Capture each call in its own CUDA graph; returns the replay functions."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:          # warm up (JIT compiles, lazy allocations) outside the capture
            c()
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c()
        graphs.append(g)
    torch.cuda.synchronize()
    return [g.replay for g in graphs]


def copy_ceiling_gbs(device: torch.device, timer: Timer, warmup_ms: float, rep_ms: float, nbytes: int) -> float:
    """Device-to-device copy of nbytes: (bytes read + bytes written) / median time, GB/s."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), warmup_ms, rep_ms)
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9


def matmul_ceiling_tflops(device: torch.device, dtype: torch.dtype, timer: Timer, warmup_ms: float,
                          rep_ms: float, n: int) -> float:
    """n x n x n matmul in dtype: 2 n^3 / median time, TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = timer(lambda: torch.matmul(a, b, out=c), warmup_ms, rep_ms)
    return 2 * n ** 3 / (t.median_us * 1e-6) / 1e12


def measure_ceilings(device: torch.device, dtype: torch.dtype, dtype_name: str, timer: Timer,
                     warmup_ms: float, rep_ms: float, copy_bytes: int = COPY_CEILING_BYTES,
                     matmul_n: int = MATMUL_CEILING_N) -> Ceilings:
    gbs = copy_ceiling_gbs(device, timer, warmup_ms, rep_ms, copy_bytes)
    tflops = matmul_ceiling_tflops(device, dtype, timer, warmup_ms, rep_ms, matmul_n)
    torch.cuda.empty_cache()
    return Ceilings(copy_gbs=gbs, matmul_tflops=tflops, copy_bytes=copy_bytes, matmul_n=matmul_n, dtype=dtype_name)


def kernel_name(key: str) -> str:
    """'void ns::(anonymous namespace)::combine_kernel<...>(...)' -> 'combine_kernel'."""
    return key.replace("(anonymous namespace)::", "").split("<")[0].split("(")[0].split("::")[-1].replace("void ", "")


def kernel_times(fn: Callable[[], Any], n: int = 20) -> dict[str, float]:
    """Device time (µs) a call of fn spends in each CUDA kernel, over n plain calls (torch.profiler): {kernel name:
    µs a call}, the launches of one name in a call added (a kernel fn launches twice counts twice; instantiations
    that share a name, e.g. PyTorch's element-wise kernels, are added up). Kernels launched fewer than n times
    (one-off setup) are left out. With programmatic dependent launch a kernel's time includes its wait for the
    kernel before it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return per_call_kernel_times(prof.key_averages(), n)


def per_call_kernel_times(averages: Any, n: int) -> dict[str, float]:
    """kernel_times' arithmetic on torch.profiler's key_averages() of n calls: per CUDA kernel name, the total device
    time over the calls divided by n."""
    out: dict[str, float] = {}
    for e in averages:
        if e.device_type.name != "CUDA" or e.count < n:
            continue
        total = getattr(e, "device_time_total", None)
        if total is None:
            total = e.cuda_time_total
        name = kernel_name(e.key)
        out[name] = out.get(name, 0.0) + total / n
    return out
