"""`rentplan verify order.json`: the first thing to run on a rented machine.

Checks the device (kind, model, usable memory, compute capability, bf16/fp8), CUDA and torch versions,
the packages the workload imports, then runs a one-configuration pilot at the ordered settings and
compares its peak and update time with the plan. Ends with adopt / do not adopt and the reasons.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from planner.errors import WorkloadError
from planner.inputs.catalog import load_catalog
from planner.models.memory_model import phase_bytes
from planner.models.timing import match_catalog_gpu
from planner.outputs.orders import load_order
from planner.records import ProbeConfig
from probes.runner import run_grid
from probes.workloads import locate_workload

MEMORY_TOLERANCE = 0.10  # the pilot's need may exceed the planned need by this much before we refuse
SLOW_TOLERANCE = 1.5  # ... and its update time the slow end of the range by this factor


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in str(text).split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _check(name: str, ok: bool | None, detail: str) -> dict:
    return {"name": name, "status": "pass" if ok else ("warn" if ok is None else "fail"), "detail": detail}


def device_checks(order: dict) -> tuple[list[dict], str | None]:
    exp = order["expect"]
    checks = []
    kind = exp["device_kind"]
    if kind in ("cuda", "rocm"):
        want = f"{exp.get('gpus') or 1} × {exp['gpu_name']}"
        if not torch.cuda.is_available():
            checks.append(_check("device", False, f"no CUDA device found: the order is for {want}"))
            return checks, None
        props = torch.cuda.get_device_properties(0)
        catalog_gpu = match_catalog_gpu(props.name, load_catalog())
        same = catalog_gpu is not None and catalog_gpu.id == exp["gpu_id"]
        checks.append(_check("device", same, f"found {torch.cuda.device_count()} × {props.name}; ordered {want}"))
        checks.append(_check("gpu count", torch.cuda.device_count() >= (exp.get("gpus") or 1),
                             f"{torch.cuda.device_count()} visible, {exp.get('gpus') or 1} ordered"))
        checks.append(_check("usable memory", props.total_memory >= 0.98 * exp["usable_bytes"],
                             f"{props.total_memory / 2**30:.2f} GiB, catalog says "
                             f"{exp['usable_bytes'] / 2**30:.2f} GiB"))
        cc = f"{props.major}.{props.minor}"
        if exp.get("bf16"):
            checks.append(_check("bf16", torch.cuda.is_bf16_supported(), f"compute capability {cc}"))
        if exp.get("fp8"):
            checks.append(_check("fp8", (props.major, props.minor) >= (8, 9), f"compute capability {cc} (needs 8.9+)"))
        if exp.get("min_cuda") and torch.version.cuda:
            ok = _version_tuple(torch.version.cuda) >= _version_tuple(exp["min_cuda"])
            checks.append(_check("CUDA", ok, f"torch built with CUDA {torch.version.cuda}; needs >= {exp['min_cuda']}"))
        return checks, "cuda"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    checks.append(_check("device", True, f"CPU order; this machine has {total / 2**30:.1f} GiB RAM"))
    need = order["plan"]["need_bytes"]
    checks.append(_check("memory", total >= need, f"need {need / 2**30:.2f} GiB of {total / 2**30:.1f} GiB"))
    return checks, "cpu"


def torch_build() -> str:
    """cuda | rocm | cpu: the build of the installed torch (not whether a device is visible)."""
    if getattr(torch.version, "hip", None):
        return "rocm"
    return "cuda" if torch.version.cuda else "cpu"


BUILD_FIX = {"cuda": "pip install --force-reinstall {req} (PyPI's Linux wheel is the CUDA build)",
             "rocm": "install the ROCm build of {req} from PyTorch's ROCm wheel index (pytorch.org, 'Get started')",
             "cpu": "any build runs a CPU order"}


def software_checks(order: dict) -> list[dict]:
    """The stack, without importing the workload: torch's version and build, rentplan's extras' packages, and
    where the workload's function is (found by reading its file, not by running it)."""
    checks = []
    want = str(order["expect"].get("torch") or "").replace(">=", "").split("(")[0].strip()
    if want:
        ok = _version_tuple(torch.__version__)[:2] >= _version_tuple(want)[:2]
        checks.append(_check("torch", ok, f"{torch.__version__} installed; order asks >= {want}"))
    stack = order["stack"]
    kind, build = stack["torch_build"], torch_build()
    if kind != "cpu":
        fix = BUILD_FIX[kind].format(req=stack["torch_requirement"])
        checks.append(_check("torch build", build == kind,
                             f"{torch.__version__} is the {build.upper()} build; the order is for {kind.upper()}"
                             + ("" if build == kind else f": {fix}")))
    try:
        checks.append(_check("workload", True, locate_workload(order["settings"]["workload"])))
    except WorkloadError as e:
        checks.append(_check("workload", False, str(e)))
    packages = stack["packages"]
    found = {p: installed_version(p) for p in packages}
    missing = [p for p, v in found.items() if v is None]
    extras = ",".join(stack["extras"])
    checks.append(_check("packages", not missing,
                         f"missing: {', '.join(missing)} (pip install 'rentplan[{extras}]')" if missing else
                         "installed: " + ", ".join(f"{p} {v}" for p, v in found.items())))
    return checks


def installed_version(name: str) -> str | None:
    """The installed distribution's version for a package name, from its metadata alone: nothing is imported or
    run (importlib.util.find_spec("a.b") imports a, and finds a folder on PYTHONPATH that nothing installed)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except (metadata.PackageNotFoundError, ValueError):
        dists = metadata.packages_distributions().get(name)  # an import name whose distribution differs (yaml)
        return metadata.version(dists[0]) if dists else None


def pilot_checks(order: dict, device: str, ledger_path: str | None, progress) -> list[dict]:
    s, plan = order["settings"], order["plan"]
    cfg = ProbeConfig(workload=s["workload"], params_json=json.dumps(s["params"], sort_keys=True),
                      micro_batch=s["micro_batch"], seq_len=s["seq_len"], eval_seq_len=s["eval_seq_len"],
                      eval_micro_batch=s["eval_micro_batch"], grad_accum=s["grad_accum"], precision=s["precision"],
                      checkpointing=bool(s["checkpointing"]), optimizer=s["optimizer"], device=device)
    tmp = None
    if ledger_path is None:
        tmp = tempfile.mkdtemp(prefix="rentplan-verify-")
        ledger_path = os.path.join(tmp, "verify.db")
    df = run_grid([cfg], ledger_path, retry_failed=True, progress=progress).frame()
    checks = []
    bad = df[df["verdict"] != "ok"]
    checks.append(_check("pilot", bad.empty and not df.empty,
                         "all phases ok" if bad.empty else
                         "; ".join(f"{r.phase} {r.verdict} {r.detail}" for r in bad.itertuples())))
    if df.empty or not bad.empty:
        return checks
    checks.append(memory_check(phase_bytes(df, load_catalog().fragmentation_factor).max(), plan))  # the plan's rule
    t = float(df[df["phase"] == "steady"]["update_s"].iloc[0])
    lo, hi = plan["update_s_low"], plan["update_s_high"]
    if lo is not None and hi is not None:
        status = True if t <= hi * SLOW_TOLERANCE else False
        if t < lo / SLOW_TOLERANCE:
            status = None  # faster than predicted: not a reason to refuse, but the plan overestimates
        checks.append(_check("update time", status, f"{t:.4f} s per update; plan range {lo:.4f}–{hi:.4f} s"))
    return checks


def memory_check(pilot_need: float, plan: dict) -> dict:
    """The pilot's need against the plan's. A CUDA reserved peak holds the BLAS workspaces, which the plan counts
    in its context when its lines did not hold them (order.json's plan.workspace_bytes): they are allowed too."""
    workspaces = int(plan.get("workspace_bytes") or 0)  # orders written before it was recorded: none
    planned = plan["need_bytes"] + workspaces
    said = f" incl. {workspaces / 2**20:.0f} MiB of BLAS workspaces from its context" if workspaces else ""
    return _check("peak memory", pilot_need <= planned * (1 + MEMORY_TOLERANCE),
                  f"pilot needs {pilot_need / 2**30:.3f} GiB; plan said {planned / 2**30:.3f} GiB{said} "
                  f"(+{MEMORY_TOLERANCE:.0%} allowed)")


def verify_order(path: str, ledger_path: str | None = None, run_pilot: bool = True, progress=print) -> dict:
    order = load_order(path)
    checks, device = device_checks(order)
    checks += software_checks(order)
    if run_pilot and device is not None and all(c["status"] != "fail" for c in checks):
        checks += pilot_checks(order, device, ledger_path, progress)
    return {"adopt": all(c["status"] != "fail" for c in checks), "checks": checks}
