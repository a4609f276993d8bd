"""The order as a SkyPilot task: `rentplan-out/sky.yaml`, launched from the launch folder (where `plan` ran) with
`sky launch -c rentplan rentplan-out/sky.yaml`.

What it says comes from order.json only: the accelerator and count, spot or on-demand, the cloud and region
where the offer names them, nodes for multi-node offers, and a disk that holds the run's checkpoints. The files
the run reads travel as `file_mounts` (planner/outputs/launch.py says where each lands). Setup installs rentplan
with the torch the pilot ran (PyPI's Linux build, which is CUDA's) and the extras the order lists; run verifies
the machine against the order, then starts the campaign: one process for `single`, through torchrun with
SkyPilot's node and rank variables for `ddp`/`fsdp`.

Nothing here is text built by hand: the task is a dict written by a YAML dumper, and each shell line is made by
`command()`, which passes every word that comes from data (paths, names, versions) through `shlex.quote`; only
words written in this file (`Shell`) reach the shell as they are.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex

import yaml

from planner import PACKAGE_DIR, __version__
from planner.inputs.campaign_spec import KEPT_CHECKPOINTS
from planner.outputs.launch import OWN_LOOPS, Launch, source_problem
from planner.outputs.orders import EXTRAS
from planner.units import fmt_bytes

GiB = 1024**3
# Catalog GPU id -> SkyPilot accelerator name (sky/catalog data, `sky show-gpus`).
ACCELERATORS = {
    "b200": "B200", "h200_sxm": "H200", "h100_sxm": "H100", "h100_pcie": "H100", "h100_nvl": "H100-NVL",
    "gh200": "GH200", "a100_80gb_sxm": "A100-80GB", "a100_80gb_pcie": "A100-80GB", "a100_40gb": "A100",
    "l40s": "L40S", "l40": "L40", "l4": "L4", "a10g": "A10G", "a10": "A10", "rtx_6000_ada": "RTX6000-Ada",
    "rtx_a6000": "RTXA6000", "rtx_4090": "RTX4090", "rtx_3090": "RTX3090", "v100_16gb": "V100",
    "v100_32gb": "V100-32GB", "t4": "T4", "mi300x": "MI300X", "mi250": "MI250",
}
# Catalog provider -> SkyPilot cloud. Others (market ranges, unlisted providers) leave the cloud to SkyPilot.
CLOUDS = {"aws": "aws", "gcp": "gcp", "azure": "azure", "lambda": "lambda", "runpod": "runpod", "vast": "vast",
          "fluidstack": "fluidstack", "paperspace": "paperspace", "cudo": "cudo", "oci": "oci", "nebius": "nebius",
          "do": "do", "hyperbolic": "hyperbolic", "ibm": "ibm", "scp": "scp"}
MIN_DISK_GB = 100
ON_DISK = KEPT_CHECKPOINTS + 1  # a new checkpoint is written whole before the oldest kept one goes (probes/campaign.py)
VENV = "~/rentplan-venv"


class Shell(str):
    """A word written in this file, passed to the shell as it is (a variable, a redirection, `~`)."""


def command(*words) -> str:
    """One shell line: words from data are quoted, Shell words are not."""
    return " ".join(w if isinstance(w, Shell) else shlex.quote(str(w)) for w in words)


def disk_gb(checkpoint_bytes: int | None, export_bytes: int | None, runs: int = 1, upload_bytes: int = 0) -> int:
    """Room for the environment and data (the 100 GB floor), the files sky.yaml uploads, and, for every run of the
    campaign (one per variant), its kept checkpoints and its exported model: each run keeps its own
    (probes/campaign.py)."""
    need = upload_bytes + runs * (ON_DISK * (checkpoint_bytes or 0) + (export_bytes or 0))
    return max(MIN_DISK_GB, MIN_DISK_GB + math.ceil(need / GiB))


MAX_LISTED = 50  # uploads listed by name in sky.yaml's comment; the rest as a count and their bytes


def disk_basis(checkpoint_bytes: int | None, export_bytes: int | None, runs: int = 1,
               uploads: dict[str, int] | None = None) -> str:
    """What disk_gb counts, with the sizes it counted, and every file uploaded with its size (comments above the
    task; names as JSON strings, so nothing in them ends a comment line)."""
    uploads = uploads or {}
    total = sum(uploads.values())
    size = lambda b: fmt_bytes(b) if b else "not measured"  # noqa: E731
    lines = [f"# disk_size {disk_gb(checkpoint_bytes, export_bytes, runs, total)} GB = {MIN_DISK_GB} GB floor "
             f"(environment, data) + uploads {fmt_bytes(total)} + {runs} run(s) × ({ON_DISK} checkpoints "
             f"({KEPT_CHECKPOINTS} kept and the one being written) × {size(checkpoint_bytes)} + export "
             f"{size(export_bytes)}), rounded up to whole GiB"]
    if uploads:
        lines.append(f"# uploaded besides the workdir ({len(uploads)} files, {fmt_bytes(total)}; file_mounts below):")
        biggest = sorted(uploads.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += [f"#   {json.dumps(rel)} {fmt_bytes(b)}" for rel, b in sorted(biggest[:MAX_LISTED])]
        if len(biggest) > MAX_LISTED:
            rest = biggest[MAX_LISTED:]
            lines.append(f"#   and {len(rest)} smaller files, {fmt_bytes(sum(b for _, b in rest))}")
    return "\n".join(lines) + "\n"


def strategy_kind(order: dict) -> str:
    """single | ddp | fsdp (orders written before strategy_label existed held the label, e.g. "ddp × 8", here)."""
    return str(order["settings"]["strategy"]).split()[0]


def launch_lines(order: dict, spec: str) -> list[str]:
    kind = strategy_kind(order)
    campaign = ["campaign", "run", spec, "--ledger", "rentplan.db", "--out", "rentplan-runs"]
    if kind == "single":
        return [command(Shell("rentplan"), *campaign)]
    # torchrun starts one process per GPU on every node; SkyPilot sets these variables on each node.
    return [Shell('MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)'),
            command(Shell("torchrun"), Shell('--nnodes="$SKYPILOT_NUM_NODES"'),
                    Shell('--nproc_per_node="$SKYPILOT_NUM_GPUS_PER_NODE"'), Shell('--node_rank="$SKYPILOT_NODE_RANK"'),
                    Shell('--master_addr="$MASTER_ADDR"'), Shell("--master_port=29500"), Shell("-m"),
                    Shell("planner.cli"), *campaign, "--strategy", kind)]


def setup_lines(order: dict, rentplan_source: str | None) -> list[str]:
    names = order["stack"]["extras"]
    if not set(names) <= set(EXTRAS):  # orders.check_order refuses these on load; an order built here has none
        raise ValueError(f"unknown rentplan extras {names!r}")
    extras = ",".join(names)
    lines = [Shell("set -euo pipefail"), command(Shell("python3"), Shell("-m"), Shell("venv"), Shell(VENV)),
             command(Shell("."), Shell(f"{VENV}/bin/activate")),
             command(Shell("pip"), Shell("install"), Shell("-q"), order["stack"]["torch_requirement"])]
    if rentplan_source:  # this rentplan, mounted at ~/rentplan; extras come from orders.EXTRAS' fixed names
        lines.append(command(Shell("pip"), Shell("install"), Shell("-q"), Shell("-e"),
                             Shell(f'"$HOME/rentplan[{extras}]"')))
    else:  # the release this plan was made with
        lines.append(command(Shell("pip"), Shell("install"), Shell("-q"), f"rentplan[{extras}]=={__version__}"))
    return lines


def run_lines(order: dict, launch: Launch) -> list[str]:
    # the working folder on the import path, as `python` run there has it: package.module:function workloads
    lines = [Shell("set -euo pipefail"), command(Shell("."), Shell(f"{VENV}/bin/activate")),
             Shell('export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"')]
    workload = str(order["settings"]["workload"])
    if workload.startswith(OWN_LOOPS):  # lines from the user's own loop: rentplan cannot start that loop itself
        s = order["settings"]
        message = (f"The campaign of {workload} is your own loop: put its command here ({strategy_kind(order)}; "
                   f"micro-batch {s['micro_batch']} x accumulation {s['grad_accum']})")
        return lines + [command(Shell("rentplan"), Shell("verify"), launch.order_path, Shell("--skip-pilot")),
                        command(Shell("echo"), message, Shell(">&2")), Shell("exit 2")]
    assert launch.spec_path is not None  # rentplan's own loop: its campaign spec travels with the order
    return lines + [command(Shell("rentplan"), Shell("verify"), launch.order_path)] + \
        launch_lines(order, launch.spec_path)


def uploads(launch: Launch, rentplan_source: str | None) -> dict[str, int]:
    """Every upload besides the workdir, with its bytes: the order's files, and this rentplan's source."""
    out = dict(launch.layout.sizes)
    if rentplan_source:
        out["~/rentplan (this rentplan's source: " + ", ".join(SOURCE_PARTS) + ")"] = source_bytes(rentplan_source)
    return out


def sky_task(order: dict, launch: Launch, checkpoint_bytes: int | None = None, export_bytes: int | None = None,
             rentplan_source: str | None = None, runs: int = 1, sent: dict[str, int] | None = None) -> dict:
    """The SkyPilot task for an order (local paths relative to the launch folder, where `sky launch` runs); sent:
    the uploads with their bytes (uploads(), counted once by sky_yaml for the disk and its comment)."""
    sent = uploads(launch, rentplan_source) if sent is None else sent
    offer, expect = order["offer"], order["expect"]
    gpu = expect["gpu_id"]
    resources: dict = {"accelerators": f"{ACCELERATORS.get(gpu, str(gpu).upper())}:{int(offer['gpus_per_instance'])}",
                       "use_spot": bool(offer.get("spot", False)),
                       "disk_size": disk_gb(checkpoint_bytes, export_bytes, runs, sum(sent.values()))}
    cloud = CLOUDS.get(str(offer.get("provider", "")).lower())
    if cloud:
        resources["cloud"] = cloud
        if offer.get("region"):
            resources["region"] = str(offer["region"])
    task: dict = {"name": "rentplan-" + (re.sub(r"[^a-z0-9-]+", "-", str(order["campaign"]).lower()).strip("-")
                                         or "campaign")[:50],
                  "resources": resources}
    if int(offer.get("nodes", 1)) > 1:
        task["num_nodes"] = int(offer["nodes"])
    task["workdir"] = "."  # the launch folder: the user's project
    mounts = launch.layout.file_mounts()
    if rentplan_source:  # the same rule as every other upload, and only what `pip install -e` needs of it
        source_problem(rentplan_source, "the rentplan source")
        mounts.update(source_mounts(rentplan_source))
    task["file_mounts"] = mounts
    task["setup"] = "\n".join(setup_lines(order, rentplan_source)) + "\n"
    task["run"] = "\n".join(run_lines(order, launch)) + "\n"
    return task


def sky_yaml(order: dict, launch: Launch, checkpoint_bytes: int | None = None, export_bytes: int | None = None,
             rentplan_source: str | None = None, runs: int = 1) -> str:
    sent = uploads(launch, rentplan_source)  # the source's folders walked once
    task = sky_task(order, launch, checkpoint_bytes, export_bytes, rentplan_source, runs, sent)
    # names in the comment as JSON strings (ASCII, escaped): nothing in them can end the comment line
    decision = order.get("decision") or {}
    chosen = ("; chosen with --offer, rentplan recommends " + json.dumps(str(decision.get("recommended")))
              if str(decision.get("chosen_by", "")).startswith("you") else "; rentplan's recommendation")
    head = (f"# SkyPilot task for the rentplan order of {json.dumps(str(order['campaign']))} "
            f"(offer {json.dumps(str(order['offer']['id']))}{chosen}).\n"
            "# Launch from the folder rentplan plan ran in: sky launch -c rentplan THIS_FILE\n"
            + disk_basis(checkpoint_bytes, export_bytes, runs, sent))
    return head + yaml.dump(task, Dumper=_BlockDumper, sort_keys=False, width=1000, allow_unicode=False)


SOURCE_PARTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "catalog.yaml", "planner", "probes",
                "templates")  # what `pip install -e ~/rentplan` builds from: never the checkout's .git, keys or venvs


def source_mounts(source: str) -> dict[str, str]:
    return {f"~/rentplan/{part}": f"{source}/{part}" for part in SOURCE_PARTS if os.path.exists(f"{source}/{part}")}


def source_bytes(source: str) -> int:
    """The bytes of those parts as SkyPilot uploads them (a folder mount leaves out what .gitignore names: here
    caches only, which this count leaves out too)."""
    total = 0
    for part in SOURCE_PARTS:
        top = os.path.join(source, part)
        if os.path.isfile(top):
            total += os.path.getsize(top)
        for folder, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            total += sum(os.path.getsize(os.path.join(folder, n)) for n in names if not n.endswith(".pyc"))
    return total


def rentplan_source() -> str | None:
    """The folder of this rentplan's source when it is a checkout (pyproject.toml beside planner/)."""
    root = PACKAGE_DIR.parent
    return str(root) if (root / "pyproject.toml").exists() else None


def order_task(order: dict, launch: Launch, lines, runs: int) -> str:
    """sky.yaml for an order, from the ledger lines the plan rests on (checkpoint and export sizes for the disk of
    `runs` runs: the campaign's variants)."""
    ids = set(str(order["plan"]["run_ids"]).replace(",", " ").split())
    mine = lines[lines["run_id"].isin(ids)] if ids else lines

    def biggest(phase):
        values = mine.loc[mine["phase"] == phase, "checkpoint_bytes"].dropna()
        return int(values.max()) if len(values) else None
    return sky_yaml(order, launch, biggest("save"), biggest("export"), rentplan_source(), runs)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line scripts as YAML literal blocks (|), as people write SkyPilot tasks."""


_BlockDumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                                  style="|" if "\n" in s else None))
_BlockDumper.add_representer(Shell, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", str(s)))
