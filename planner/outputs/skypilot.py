"""The order as a SkyPilot task: `rentplan-out/sky.yaml`, launched with `sky launch -c rentplan rentplan-out/sky.yaml`.

What it says comes from order.json only: the accelerator and count, spot or on-demand, the cloud and region
where the offer names them, nodes for multi-node offers, and a disk that holds the run's checkpoints. Setup
installs rentplan with the torch the pilot ran (CUDA build); run verifies the machine against the order, then
starts the campaign: one process for `single`, through torchrun with SkyPilot's node and rank variables for
`ddp`/`fsdp`. SkyPilot's names (accelerators, clouds) are those of `sky show-gpus` and `sky check`.
"""

from __future__ import annotations

import math
import re

import yaml

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
OWN_LOOPS = ("trainer:", "lightning:", "script:")  # workloads measured by callbacks or probe --script
KEPT_CHECKPOINTS = 3  # the campaign keeps the newest checkpoints of each running variant


def disk_gb(checkpoint_bytes: int | None, export_bytes: int | None) -> int:
    """Room for the environment and data (the 100 GB floor) plus kept checkpoints and the exported model."""
    need = KEPT_CHECKPOINTS * (checkpoint_bytes or 0) + (export_bytes or 0)
    return max(MIN_DISK_GB, MIN_DISK_GB + math.ceil(need / GiB))


def strategy_kind(order: dict) -> str:
    """single | ddp | fsdp (orders written before strategy_label existed held the label, e.g. "ddp × 8", here)."""
    return str(order["settings"]["strategy"]).split()[0]


def launch_command(order: dict, spec: str) -> str:
    kind = strategy_kind(order)
    campaign = f"campaign run {spec} --ledger rentplan.db --out rentplan-runs"
    if kind == "single":
        return f"rentplan {campaign}"
    campaign += f" --strategy {kind}"
    # torchrun starts one process per GPU on every node; SkyPilot sets these variables on each node.
    return ("MASTER_ADDR=$(echo \"$SKYPILOT_NODE_IPS\" | head -n1)\n"
            "torchrun --nnodes=\"$SKYPILOT_NUM_NODES\" --nproc_per_node=\"$SKYPILOT_NUM_GPUS_PER_NODE\" "
            "--node_rank=\"$SKYPILOT_NODE_RANK\" --master_addr=\"$MASTER_ADDR\" --master_port=29500 "
            f"-m planner.cli {campaign}")


def sky_task(order: dict, order_path: str, spec_path: str, torch_pin: str, checkpoint_bytes: int | None = None,
             export_bytes: int | None = None, rentplan_source: str | None = None) -> dict:
    """The SkyPilot task for an order (paths are relative to the folder `sky launch` runs in)."""
    offer, expect = order["offer"], order["expect"]
    gpu = expect["gpu_id"]
    resources: dict = {"accelerators": f"{ACCELERATORS.get(gpu, gpu.upper())}:{offer['gpus_per_instance']}",
                       "use_spot": bool(offer.get("spot", False)),
                       "disk_size": disk_gb(checkpoint_bytes, export_bytes)}
    cloud = CLOUDS.get(str(offer.get("provider", "")).lower())
    if cloud:
        resources["cloud"] = cloud
        if offer.get("region"):
            resources["region"] = str(offer["region"])
    task: dict = {"name": "rentplan-" + re.sub(r"[^a-z0-9-]+", "-", order["campaign"].lower()).strip("-"),
                  "resources": resources}
    if int(offer.get("nodes", 1)) > 1:
        task["num_nodes"] = int(offer["nodes"])
    task["workdir"] = "."  # the user's project: workload, campaign spec and order
    extras = "probe,hf" if str(order["settings"]["workload"]).startswith("hf:") else "probe"
    if rentplan_source:  # this rentplan, copied to the machine
        task["file_mounts"] = {"~/rentplan": rentplan_source}
        install = f"pip install -q -e ~/rentplan'[{extras}]'"
    else:
        install = f"pip install -q 'rentplan[{extras}]'"
    task["setup"] = ("set -euo pipefail\n"
                     "python3 -m venv ~/rentplan-venv && . ~/rentplan-venv/bin/activate\n"
                     f"pip install -q '{torch_pin}'  # the torch the pilot ran; on Linux PyPI's build is CUDA's\n"
                     f"{install}\n")
    workload = str(order["settings"]["workload"])
    if workload.startswith(OWN_LOOPS):  # lines from the user's own loop: rentplan cannot start that loop itself
        run = (f"rentplan verify {order_path} --skip-pilot   # the stack; the pilot needs a rentplan workload\n"
               f"echo 'The campaign of {workload} is your own loop: put its command here "
               f"({strategy_kind(order)}; micro-batch {order['settings']['micro_batch']} x accumulation "
               f"{order['settings']['grad_accum']})' >&2\n"
               "exit 2\n")
    else:
        run = f"rentplan verify {order_path}\n{launch_command(order, spec_path)}\n"
    task["run"] = "set -euo pipefail\n. ~/rentplan-venv/bin/activate\n" + run
    return task


def sky_yaml(order: dict, order_path: str, spec_path: str, torch_pin: str, checkpoint_bytes: int | None = None,
             export_bytes: int | None = None, rentplan_source: str | None = None) -> str:
    task = sky_task(order, order_path, spec_path, torch_pin, checkpoint_bytes, export_bytes, rentplan_source)
    head = (f"# SkyPilot task for the rentplan order of '{order['campaign']}' ({order['offer']['id']}, "
            f"{order['settings'].get('strategy_label', order['settings']['strategy'])}).\n"
            f"# Launch from the project's folder: sky launch -c rentplan {{this file}}\n")
    return head + yaml.dump(task, Dumper=_BlockDumper, sort_keys=False, width=1000)


def torch_pin(versions: list[str]) -> str:
    """The torch the pilot ran, as a pip requirement for a CUDA machine (a +cpu build's version, without +cpu)."""
    clean = sorted({v.split("+")[0] for v in versions if v})
    return f"torch=={clean[-1]}" if clean else "torch>=2.4"


def rentplan_source() -> str | None:
    """The folder of this rentplan's source when it is a checkout (pyproject.toml beside planner/)."""
    from planner import PACKAGE_DIR

    root = PACKAGE_DIR.parent
    return str(root) if (root / "pyproject.toml").exists() else None


def order_task(order: dict, lines, out_dir: str, spec_path: str) -> str:
    """sky.yaml for an order written to out_dir, from the ledger lines the plan rests on."""
    import os

    ids = set(str(order["plan"]["run_ids"]).replace(",", " ").split())
    mine = lines[lines["run_id"].isin(ids)] if ids else lines
    def biggest(phase):
        values = mine.loc[mine["phase"] == phase, "checkpoint_bytes"].dropna()
        return int(values.max()) if len(values) else None
    rel = lambda p: os.path.relpath(p, os.getcwd())  # noqa: E731  sky launch runs where plan ran
    return sky_yaml(order, rel(os.path.join(out_dir, "order.json")), rel(spec_path),
                    torch_pin(list(lines["torch_version"].dropna())), biggest("save"), biggest("export"),
                    rentplan_source())


class _BlockDumper(yaml.SafeDumper):
    """Multi-line scripts as YAML literal blocks (|), as people write SkyPilot tasks."""


_BlockDumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                                  style="|" if "\n" in s else None))
