"""rentplan's Python API for probing: a grid (the options `rentplan probe` takes), run into a ledger; the command
only parses its options, calls these and prints. Importing this module imports no torch; running a grid does.

    from probes import api
    result = api.probe(api.grid(workload="builtin:gpt", micro_batch="1,4", seq_len="128"), ledger="rentplan.db")
    result.frame()
"""

from __future__ import annotations

from typing import Callable

from planner.inputs.grid import GridSpec, build_grid, checked_device, checked_timeout, spec_from_options
from planner.records import PHASES

Say = Callable[[str], None]


def _silent(msg: str) -> None:
    pass


def device(name: str = "auto", ranks: int = 1) -> str:
    """auto | cpu | cuda | cuda:N: a device this machine lacks (or too few GPUs for `ranks` ranks, each on its own
    cuda:LOCAL_RANK) is refused before anything runs."""
    name = checked_device(name)
    if name == "cpu":
        return name
    from probes.pilot import available_device  # torch: only a device other than the CPU asks it

    return available_device(name, ranks)


def grid(**options) -> GridSpec:
    """The grid the options (the probe command's, by their Python names; grid_file a probe YAML) describe, on a
    device this machine has."""
    spec = spec_from_options(options)
    spec.device = device(spec.device, spec.nproc if spec.mode == "measured" else 1)
    return spec


def banner(spec: GridSpec, n: int) -> str:
    """What runs where: a probe measures on its device; an estimate runs fake tensors on this CPU for the kernels
    of its targets (the CPU is not what it sizes)."""
    if spec.mode != "estimated":
        return f"probe: {n} configuration(s) × {len(PHASES)} phases on {spec.device}"
    targets = sorted({t or "cpu" for t in (spec.targets or [""])})
    return (f"estimate: {n} configuration(s) × {len(PHASES)} phases for the kernels of {', '.join(targets)}, "
            "under fake tensors on this machine's CPU (no memory touched)")


def probe(spec: GridSpec, ledger: str = "rentplan.db", timeout_s: float = 900.0, retry_failed: bool = False,
          jobs: int | None = None, say: Say | None = None):
    """Check the workload here (clear errors before any worker starts), then run the grid: every configuration
    through every phase, one ledger line per phase. Returns the runner's GridResult (its lines, `.frame()`, and
    whether Ctrl-C ended it). say: told the progress lines."""
    say = say or _silent
    checked_timeout(timeout_s)
    from probes.runner import run_grid, start_workers

    start_workers()  # warms up in parallel with the check below
    from probes.workloads import load_workload

    workload = load_workload(spec.workload, spec.params)
    lengths = getattr(workload, "lengths", None)
    if lengths and not spec.seq_len:  # the data's real lengths, not a guess
        spec.seq_len, spec.eval_seq_len = [lengths["p99"]], spec.eval_seq_len or [lengths["max"]]
        say(f"data: {lengths['examples']} examples; p99 length {lengths['p99']} tokens drives steady, "
            f"the longest ({lengths['max']}) drives eval")
    if getattr(workload, "data_note", None):
        say(f"data: {workload.data_note}")
    if hasattr(workload, "data_report"):
        notes = dict.fromkeys(n for seq_len in sorted(set(spec.seq_len or []))
                              for n in workload.data_report({"train": seq_len}))
        for note in notes:
            say(f"data: {note}")
    configs = build_grid(spec)
    say(f"{banner(spec, len(configs))}; ledger {ledger}")
    return run_grid(configs, ledger, timeout_s=timeout_s, retry_failed=retry_failed, progress=say, jobs=jobs)


__all__ = ["banner", "device", "grid", "probe"]
