"""Find the largest micro-batch (or sequence length) that fits under a cap, with as few real probes as possible.

1. Estimates (fake tensors: no memory touched, so they cost no real probe) at sizes growing ×4 until the
   estimated peak passes the cap, then narrowed with the memory model's prediction (bisection as fallback).
2. Real probes at the predicted edge: the size must run under the cap and one step more must not; when
   reality disagrees, the model is refit with the real lines and the bracket narrowed again.
3. The answer is always the largest size that actually ran under the cap, never an untested one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pandas as pd

from planner.inputs.grid import GridSpec, build_grid
from planner.ledger import lines_frame
from planner.models.memory_model import build_model, max_micro_batch, max_seq_len, phase_bytes
from planner.records import Line, ProbeConfig
from probes.runner import run_grid


@dataclass
class SearchResult:
    dimension: str
    best: int | None  # the largest size that ran ok under the cap (None: not even the smallest)
    failed_above: int | None  # the smallest size that failed (None: never failed within the limit)
    real_probes: int
    estimate_probes: int
    tried: list[tuple[int, str]] = field(default_factory=list)  # (size, ok|oom|...) in order
    bound: str = ""  # what stopped the search short of its limit besides memory (the model's position limit)


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


def find_max(spec: GridSpec, dimension: str, ledger: str, limit: int = 4096, max_real: int = 12,
             max_estimates: int = 16, progress=print) -> SearchResult:
    base = dataclasses.replace(build_grid(spec)[0], mode="measured")
    if base.cap_bytes is None:
        raise ValueError("--find needs --cap GPU_ID or --cap SIZE: the search is for what fits under it")
    step = 1 if dimension == "max-micro-batch" else 16
    seen: list[Line] = []  # the lines of every size this search tried, measured and estimated
    res = SearchResult(dimension, None, None, 0, 0)

    def run(size: int, mode: str) -> tuple[bool, pd.DataFrame]:
        cfg = _configs(base, dimension, size, mode)
        if mode == "estimated":  # no memory is touched: no cap, CPU kernels
            cfg = dataclasses.replace(cfg, cap="", cap_bytes=None, device="cpu")
        out = run_grid([cfg], ledger, retry_failed=True, progress=progress)
        seen.extend(out.lines)
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
        ok, df = run(guess, "measured")
        lo, hi = (guess, hi) if ok else (lo, guess)
        if hi is not None and hi - lo <= step:
            break
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
