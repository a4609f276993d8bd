"""Find the largest micro-batch (or sequence length) that fits under a cap, with as few real probes as possible.

1. Estimates (fake tensors: no memory touched, so they cost no real probe) at sizes growing ×4 until the
   estimated peak passes the cap, then narrowed with the memory model's prediction (bisection as fallback).
2. Real probes at the predicted edge: the size must run under the cap and one step more must not; when
   reality disagrees, the model is refit with the real lines and the bracket narrowed again.
3. The answer is always the largest size that actually ran under the cap, never an untested one.

On a CPU the real probes take this machine's own memory, whatever the cap: before each one the search reads
MemAvailable and stops short of a size that the growth measured so far (peak RSS above the worker's setup ÷ the
modelled need, and the line through the last two sizes) predicts past it; the answer says the host bounded it.
Before any real probe that growth is unknown and the smallest size is always tried: its probe measures what a
worker holds. One Ctrl-C or SIGTERM ends the whole search (exit 130): the lines measured so far stay in the ledger.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass, field

import pandas as pd

from planner.errors import sigterm_as_interrupt
from planner.inputs.grid import GridSpec, build_grid
from planner.ledger import lines_frame
from planner.models.memory_model import build_model, max_micro_batch, max_seq_len, phase_bytes
from planner.records import Line, ProbeConfig
from planner.units import fmt_bytes
from probes.memory import _rss
from probes.runner import run_grid

HOST_SHARE = 0.9  # of MemAvailable a real probe may grow to: the rest for the system and other processes
UNMEASURED = 2.0  # RSS above a worker's setup ÷ the modelled need, before a probe measures it (1.4-1.7 seen)


@dataclass
class SearchResult:
    dimension: str
    best: int | None  # the largest size that ran ok under the cap (None: not even the smallest)
    failed_above: int | None  # the smallest size that failed (None: never failed within the limit)
    real_probes: int
    estimate_probes: int
    tried: list[tuple[int, str]] = field(default_factory=list)  # (size, ok|oom|...) in order
    bound: str = ""  # what stopped the search short of its limit besides the cap (position limit, host memory)
    host_bound: bool = False  # this machine's available memory stopped it (a CPU search)
    interrupted: bool = False  # Ctrl-C or SIGTERM ended it


def _configs(base: ProbeConfig, dimension: str, size: int, mode: str) -> ProbeConfig:
    if dimension == "max-micro-batch":
        return dataclasses.replace(base, micro_batch=size, eval_micro_batch=size, mode=mode)
    return dataclasses.replace(base, seq_len=size, eval_seq_len=size, mode=mode)


def _verdict(df: pd.DataFrame) -> str:
    if df.empty:
        return "not run"  # another probe holds the configuration now: nothing to judge it by
    bad = df[df["verdict"] != "ok"]
    return "ok" if bad.empty else str(bad.iloc[0]["verdict"])


def _inside(guess: int, lo: int, hi: int | None, step: int) -> int:
    """The guess if it lies strictly inside the bracket, else its midpoint (or the next size up when open)."""
    if guess > lo and (hi is None or guess < hi):
        return guess
    if hi is None:
        return max(step, lo * 2)
    return max(lo + step, (lo + hi) // 2 // step * step)


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what the kernel says can be allocated without swapping); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class HostPoint:
    """One real probe's use of this machine: its size, its peak RSS, its RSS at setup (the worker before the
    batch: torch, the model), and the memory model's need at its size."""

    size: int
    peak_rss: float
    setup_rss: float
    need: float


def host_need(size: int, points: list[HostPoint], need: float) -> float:
    """Peak RSS expected of a real probe at `size`, whose modelled need is `need`: the worker's setup RSS plus
    the need times the ratio the probes measured (RSS above setup ÷ need, the largest seen: the CPU's allocator
    keeps more than the tensors); with two sizes, never below the line through the last two. Before any real
    probe: this process's own RSS (torch, as a worker holds it) plus UNMEASURED × the need."""
    if not points:
        return (_rss() or 0) + UNMEASURED * need
    ratio = max((p.peak_rss - p.setup_rss) / p.need for p in points if p.need > 0) if any(
        p.need > 0 for p in points) else UNMEASURED
    out = max(p.setup_rss for p in points) + max(ratio, 1.0) * need
    by_size = sorted(points, key=lambda p: p.size)
    if len(by_size) >= 2 and by_size[-1].size > by_size[-2].size:
        a, b = by_size[-2], by_size[-1]
        out = max(out, b.peak_rss + (b.peak_rss - a.peak_rss) / (b.size - a.size) * (size - b.size))
    return out


def find_max(spec: GridSpec, dimension: str, ledger: str, limit: int = 4096, max_real: int = 12,
             max_estimates: int = 16, progress=print) -> SearchResult:
    """The search (see the module's docstring); Ctrl-C or SIGTERM ends it with `interrupted` set."""
    previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)  # between probes too, not only in one
    res = SearchResult(dimension, None, None, 0, 0)
    try:
        return _find_max(spec, dimension, ledger, limit, max_real, max_estimates, progress, res)
    except KeyboardInterrupt:
        res.interrupted = True
        return res
    finally:
        signal.signal(signal.SIGTERM, previous)


def _find_max(spec: GridSpec, dimension: str, ledger: str, limit: int, max_real: int, max_estimates: int,
              progress, res: SearchResult) -> SearchResult:
    base = dataclasses.replace(build_grid(spec)[0], mode="measured")
    if base.cap_bytes is None:
        raise ValueError("--find needs --cap GPU_ID or --cap SIZE: the search is for what fits under it")
    step = 1 if dimension == "max-micro-batch" else 16
    seen: list[Line] = []  # the lines of every size this search tried, measured and estimated
    on_host = base.device == "cpu"
    if on_host:
        progress(f"--find on the CPU: real probes use this machine's available memory "
                 f"({fmt_bytes(host_available_bytes()) or 'unknown'} now, MemAvailable); the search stops before a "
                 "size that the growth measured so far predicts past it")

    def run(size: int, mode: str) -> tuple[bool, pd.DataFrame]:
        cfg = _configs(base, dimension, size, mode)
        if mode == "estimated":  # no memory is touched: no cap, CPU kernels
            cfg = dataclasses.replace(cfg, cap="", cap_bytes=None, device="cpu")
        out = run_grid([cfg], ledger, retry_failed=True, progress=progress)
        seen.extend(out.lines)
        if out.interrupted:  # the size in flight has its interrupted line; the search ends here
            if mode == "measured":
                res.tried.append((size, "interrupted"))
            raise KeyboardInterrupt
        _bound_by_positions(out.lines)
        mine = out.frame()
        ok = _verdict(mine) == "ok"
        if mode == "estimated":
            res.estimate_probes += 1
            # the cap's rule on a real probe is CUDA's (the modelled caching allocator under it as its limit): the
            # estimate's need is its simulated reserved peak
            return ok and phase_bytes(mine, 1.0).max() <= base.cap_bytes, lines_frame(seen)
        res.real_probes += 1
        res.tried.append((size, _verdict(mine)))
        return ok, lines_frame(seen)

    def _bound_by_positions(lines: list[Line]) -> None:
        """A sequence search stops at the model's position limit: longer inputs would index past its table."""
        nonlocal limit
        if dimension != "max-seq-len":
            return
        for ln in lines:
            if ln.phase == "setup" and ln.position_limit and ln.position_limit < limit:
                limit = ln.position_limit
                res.bound = f"the model's position limit ({ln.position_limit_basis})"

    def shape(size: int) -> tuple[int, int, int, int]:
        if dimension == "max-micro-batch":
            return size, base.seq_len, size, base.eval_seq_len
        return base.micro_batch, size, base.eval_micro_batch, size

    def host_limit(guess: int, df: pd.DataFrame, done: int) -> int:
        """The largest size up to `guess` whose expected peak RSS fits HOST_SHARE of what is available now
        (`done`: the largest size that already ran)."""
        available = host_available_bytes()
        if not on_host or available is None:
            return guess
        model = build_model(df, 1.0) if len(df) else None

        def need(size: int) -> float:
            return model.need(*shape(size)).bytes if model is not None else 0.0

        def expected(size: int) -> float:
            return host_need(size, points, need(size))

        real = df[(df["mode"] == "measured") & df["device_used_bytes"].notna()] if len(df) else df
        points = []
        for _, g in real.groupby("run_id") if len(real) else ():
            setup = g[g["phase"] == "setup"]["device_used_bytes"]
            size = int(g[dimension_col].iloc[0])
            points.append(HostPoint(size, float(g["device_used_bytes"].max()),
                                    float(setup.iloc[0]) if len(setup) else float(g["device_used_bytes"].min()),
                                    need(size)))
        budget = HOST_SHARE * available
        if expected(guess) <= budget:
            return guess
        lo, hi = 0, guess  # lo fits (0: nothing), hi does not
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step or step
            if mid <= lo:
                break
            lo, hi = (mid, hi) if expected(mid) <= budget else (lo, mid)
        if lo == 0 and not points:
            # before any real probe the guess stands on this process's RSS, no measure of a worker's (a long-lived
            # caller holds far more): the smallest size's probe measures what a worker really holds
            progress(f"--find: {guess} would need about {fmt_bytes(expected(guess))} of this machine's "
                     f"{fmt_bytes(available)} available by this process's memory; trying {step} first to measure "
                     "what a probe holds")
            return step
        res.host_bound = True
        res.bound = (f"this machine's available memory: {fmt_bytes(available)} (MemAvailable), of which the search "
                     f"lets a probe take {HOST_SHARE:.0%}; {guess} would need about {fmt_bytes(expected(guess))} "
                     "by the growth measured so far")
        progress(f"--find: {res.bound}; " + (f"trying no size above {lo}" if lo > done else
                                              f"stopping at {done}" if done else "no size fits"))
        return lo

    dimension_col = "micro_batch" if dimension == "max-micro-batch" else "seq_len"

    def predict(df: pd.DataFrame) -> int:
        model = build_model(df, 1.0)  # the need rule: simulated reserved, as the cap counts it
        if model is None:
            return 0
        if dimension == "max-micro-batch":
            return max_micro_batch(model, base.seq_len, None, base.eval_seq_len, base.cap_bytes, limit)[0]
        return max_seq_len(model, base.micro_batch, base.cap_bytes, limit, multiple=step)[0]

    # 1) Estimates: grow ×4 until the estimated peak passes the cap, then narrow with the model's prediction.
    lo, hi, size = 0, None, step if dimension == "max-micro-batch" else 64
    while size <= limit and res.estimate_probes < max_estimates and (hi is None or hi - lo > step):
        fits, df = run(size, "estimated")
        lo, hi = (size, hi) if fits else (lo, size)
        size = _inside(predict(df), lo, hi, step) if hi is not None else size * 4
    # 2) Real probes at the predicted edge: confirm it runs and that one step more does not.
    guess = min(lo or step, limit)
    lo, hi = 0, None
    while res.real_probes < max_real:
        if guess > limit:  # past the model's position limit: the limit itself is the last size to try
            if lo >= limit:
                break
            guess = limit
        top = host_limit(guess, lines_frame(seen), lo)
        held = top < guess  # past what this machine holds: its largest size instead, while that says something new
        if held:
            if top < lo + max(step, lo // 16):
                break
            guess = top
        ok, df = run(guess, "measured")
        lo, hi = (guess, hi) if ok else (lo, guess)
        if hi is not None and hi - lo <= step:
            break
        if held and ok and hi is None:  # aim at the cap's edge again; the host's limit, measured anew, clamps it
            guess = max(predict(df), lo + step)
        else:
            guess = lo + step if ok and hi is None else _inside(predict(df), lo, hi, step)
    res.best = lo or None
    res.failed_above = hi
    return res


def doubling_search(spec: GridSpec, dimension: str, ledger: str, limit: int = 4096, progress=print) -> SearchResult:
    """Lightning's method, for comparison: double until a failure, then binary search in between."""
    base = dataclasses.replace(build_grid(spec)[0], mode="measured")
    res = SearchResult(dimension, None, None, 0, 0)
    step = 1 if dimension == "max-micro-batch" else 16

    def probe(size):
        cfg = _configs(base, dimension, size, "measured")
        v = _verdict(run_grid([cfg], ledger, retry_failed=True, progress=progress).frame())
        res.real_probes += 1
        res.tried.append((size, v))
        return v

    size, lo, hi = step, 0, None
    while size <= limit:
        if probe(size) == "ok":
            lo, size = size, size * 2
        else:
            hi = size
            break
    while hi is not None and hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if probe(mid) == "ok":
            lo = mid
        else:
            hi = mid
    res.best, res.failed_above = lo or None, hi
    return res
