"""Offers with several GPUs (and several nodes): the strategy per offer and why, collectives timed from the
catalog's links, per-GPU need from FSDP lines. Pure planner: no torch."""

import math

import pytest
import yaml

from planner.decisions.select import NO_FIT, ddp_need, select
from planner.errors import CatalogError
from planner.inputs.campaign_spec import load_campaign_text
from planner.inputs.catalog import Offer, load_catalog, parse_catalog
from planner.ledger import read_lines
from planner.models.memory_model import Need
from planner.models.overheads import DDP_BROADCAST_BYTES
from planner.models.timing import Throughput, comm_time
from tests.factories import GiB, MiB, campaign_yaml, config, pilot_lines, write_ledger

CATALOG = load_catalog()


def tp(grad_bytes=10**9, param_bytes=10**9) -> Throughput:
    return Throughput(flops_per_token=1.0, ops_per_micro_batch=None, measured_s_per_token=None, device="cpu",
                      device_name="Test CPU", grad_bytes=grad_bytes, param_bytes=param_bytes, micro_batch=1,
                      seq_len=1, grad_accum=1)


def offer(gpus=8, nodes=1, **kw) -> Offer:
    base = dict(id="test-offer", gpu="h100_sxm", provider="test", gpus_per_instance=gpus,
                price_per_instance_hour_usd=20.0, spot=False, as_of="2026-12-01", source="test", nodes=nodes)
    if nodes > 1:
        base.update(network="InfiniBand NDR", network_gbps=3200.0)
    return Offer(**{**base, **kw})


def test_collectives_are_ring_times_over_the_catalog_links():
    h100 = CATALOG.gpu("h100_sxm")  # NVLink 900 GB/s bidirectional: 450 GB/s each way
    # NCCL's ring latency (Simple): 8.4 µs + 3.4 µs a step over NVLink, 9.6 µs over the network;
    # 1 GB of gradients is 1 + ceil((1e9 - 1 MiB) / 25 MiB) = 40 DDP buckets
    ddp = comm_time(tp(), "ddp", h100, offer(), grad_accum=4)
    lat8 = (8.4 + 14 * 3.4) * 1e-6
    assert math.isclose(ddp.seconds, 2 * 7 / 8 * 1e9 / 450e9 + 40 * lat8)  # once per update, whatever the accumulation
    fsdp = comm_time(tp(), "fsdp", h100, offer(), grad_accum=4)
    lat_ag = (8.4 + 7 * 3.4) * 1e-6
    assert math.isclose(fsdp.seconds, 4 * (2e9 + 1e9) * 7 / 8 / 450e9 + 12 * lat_ag)  # 2 all-gathers + reduce-scatter
    two = comm_time(tp(), "ddp", h100, offer(nodes=2), grad_accum=1)
    lat16 = (8.4 + 28 * 3.4 + 2 * 9.6) * 1e-6
    assert math.isclose(two.seconds, 2 * 7 / 8 * 1e9 / 450e9 + 2 * 1 / 2 * 1e9 / 400e9 + 40 * lat16)  # 400 GB/s
    assert "between 2 nodes" in two.basis and "(estimated" in two.basis and "NCCL ring latency" in two.basis
    pcie = comm_time(tp(), "ddp", CATALOG.gpu("l4"), offer(gpu="l4"), grad_accum=1)
    assert pcie.seconds > ddp.seconds  # no NVLink: PCIe


def test_a_small_all_reduce_still_costs_nccls_latency():
    """User: `rentplan demo` showed a 0.0 ms all-reduce for a small model on 2 × RTX 3090: a collective is
    never free, whatever its size."""
    small = comm_time(tp(grad_bytes=4 * 100_000), "ddp", CATALOG.gpu("rtx_3090"), offer(gpus=2, gpu="rtx_3090"), 1)
    assert small.seconds >= (8.4 + 2 * 3.4) * 1e-6
    assert "0.0 ms" not in small.basis and "µs" in small.basis


def ledger(tmp_path, peak=lambda mb, seq: 100 * MiB + mb * seq * 50_000, flops=1e12, trainable=1_000_000,
           extra=()):
    lines = []
    for mb, seq in [(1, 128), (2, 128), (1, 256), (4, 256)]:
        cfg = config(micro_batch=mb, seq_len=seq, eval_seq_len=seq, eval_micro_batch=mb)
        lines += pilot_lines(cfg, peak(mb, seq), flops_per_update=flops, params=trainable)
    return read_lines(write_ledger(tmp_path / "l.db", lines + list(extra)))


def row(sheet, offer_id):
    return sheet[sheet["offer"] == offer_id].iloc[0]


def test_ddp_when_replicas_are_faster_single_when_the_all_reduce_eats_the_gain(tmp_path):
    camp = load_campaign_text(campaign_yaml(), "t")
    offers = [offer(id="h100-1x", gpus=1), offer(id="h100-8x"), offer(id="l4-8x", gpu="l4")]
    heavy = select(camp, ledger(tmp_path, flops=1e15), CATALOG, offers=offers)  # compute-bound: split it
    assert row(heavy, "h100-1x")["strategy"] == "single"
    assert row(heavy, "h100-1x")["strategy_why"] == "one GPU per instance"
    eight = row(heavy, "h100-8x")
    assert eight["strategy_label"] == "ddp × 8" and eight["replicas"] == 8
    assert eight["examples_per_update"] == 16 and eight["micro_batch"] * eight["grad_accum"] == 2
    assert "DDP × 8: a replica fits one GPU; 8 replicas:" in eight["strategy_why"]
    assert "all-reduce of the gradients" in eight["time_basis"]
    # how the collectives are counted beside compute is said, and is what the range does
    assert "fast end fully overlapped with compute, point half, slow end not at all" in eight["time_basis"]
    assert eight["update_s_low"] <= eight["update_s_high"]
    assert eight["update_s_high"] < row(heavy, "h100-1x")["update_s_high"]

    (tmp_path / "b").mkdir()
    light = select(camp, ledger(tmp_path / "b", flops=1e9, trainable=2_000_000_000), CATALOG, offers=offers)
    l4 = row(light, "l4-8x")  # 8 GB of gradients over PCIe against a launch-bound update: no gain
    assert l4["strategy"] == "single" and l4["replicas"] == 1
    assert "DDP × 8 would not be faster" in l4["strategy_why"] and "7 of 8 GPUs would idle" in l4["strategy_why"]


def test_ddp_need_adds_the_gradient_buckets_where_one_process_has_no_gradients(tmp_path):
    camp = load_campaign_text(campaign_yaml(), "t")
    lines = ledger(tmp_path, trainable=50_000_000, flops=1e15)  # 200 MB of fp32 gradients
    sheet = select(camp, lines, CATALOG, offers=[offer(id="one", gpus=1), offer(id="two", gpus=2)])
    one, two = row(sheet, "one"), row(sheet, "two")
    assert two["strategy_label"] == "ddp × 2" and "DDP: + gradient buckets" in two["need_basis"]
    assert two["need_bytes"] >= one["need_bytes"] - 1  # never below the single-process need


def test_a_ddp_setup_holds_buckets_beside_the_broadcast_copies_of_the_parameters():
    """Plain SGD (no optimizer state): one process peaks in training at 2 x the parameters plus activations,
    but a DDP rank's constructor can hold the parameters, their gradient buckets and the flattened copies it
    broadcast from rank 0 at once (tests/test_distributed.py saw 3.0 x on a 2-core CI machine)."""
    p = 4 * GiB
    act = GiB // 2
    single = {"setup": p, "first_step": 2 * p + act, "steady": 2 * p + act, "eval": p + act, "save": p,
              "export": p, "resume": 2 * p + act}
    need = ddp_need(Need(2 * p + act, "first_step", "measured", False, single), p, 1, DDP_BROADCAST_BYTES)
    assert need.phase == "setup" and need.bytes == p + p + 750 * MiB  # copies: 3 buckets of 250 MiB at most
    assert need.per_phase["eval"] == p + act + p and need.per_phase["steady"] == 2 * p + act
    assert "broadcast copies (750.0 MiB) at setup" in need.basis
    small = ddp_need(Need(3 * MiB, "steady", "m", False, {"setup": MiB, "steady": 3 * MiB}), MiB, 1, MiB)
    assert small.per_phase["setup"] == 3 * MiB  # a small model's copy is all of its parameters


def test_fsdp_need_comes_from_fsdp_lines_when_the_ledger_has_them(tmp_path):
    camp = load_campaign_text(campaign_yaml(), "t")
    huge = lambda mb, seq: 100 * GiB + mb * seq * 50_000  # noqa: E731  does not fit one GPU
    sharded = []
    for mb, seq in [(1, 256), (2, 256)]:
        cfg = config(micro_batch=mb, seq_len=seq, eval_seq_len=seq, eval_micro_batch=mb, strategy="fsdp",
                     world_size=8, mode="estimated")
        sharded += pilot_lines(cfg, 20 * GiB + mb * seq * 50_000)
    derived = select(camp, ledger(tmp_path, peak=huge), CATALOG, offers=[offer()])
    (tmp_path / "b").mkdir()
    measured = select(camp, ledger(tmp_path / "b", peak=huge, extra=sharded), CATALOG, offers=[offer()])
    d, m = derived.iloc[0], measured.iloc[0]
    assert d["verdict"] == NO_FIT  # the derived estimate (states / 8 + the rest) cannot shed 100 GiB of activations
    assert m["strategy_label"] == "fsdp × 8" and m["verdict"] != NO_FIT
    assert m["need_basis"].startswith("per rank from FSDP × 8 lines")
    assert m["need_bytes"] == pytest.approx(1.15 * (20 * GiB + m["micro_batch"] * 256 * 50_000), rel=1e-6)
    assert "do not fit one GPU" in m["strategy_why"] and m["replicas"] == 8


def test_multi_node_offers_pay_every_node_and_time_the_network(tmp_path):
    camp = load_campaign_text(campaign_yaml(effective_batch=32), "t")
    lines = ledger(tmp_path, flops=1e15)
    sheet = select(camp, lines, CATALOG, offers=[offer(id="1node"), offer(id="2nodes", nodes=2)])
    one, two = row(sheet, "1node"), row(sheet, "2nodes")
    assert two["replicas"] == 16 and two["strategy_label"] == "ddp × 16" and two["nodes"] == 2
    assert two["price_per_hour_usd"] == 40.0 and one["price_per_hour_usd"] == 20.0
    assert math.isclose(two["campaign_cost_usd_high"], 40.0 * two["campaign_hours_high"])
    assert "InfiniBand NDR 3200 Gb/s between 2 nodes" in two["time_basis"]


def test_catalog_multi_node_offer_must_name_its_network():
    doc = yaml.safe_load(open("catalog.yaml"))
    doc["offers"][0]["nodes"] = 2
    doc["offers"][1]["nodes"] = 0
    with pytest.raises(CatalogError) as e:
        parse_catalog(doc, "test")
    msg = str(e.value)
    assert "offers[0].network: required when nodes > 1" in msg and "offers[0].network_gbps: required" in msg
    assert "offers[1].nodes: must be > 0" in msg
    doc["offers"][0].update(network="RoCE", network_gbps=800)
    doc["offers"][1]["nodes"] = 1
    cat = parse_catalog(doc, "test")
    assert cat.offers[0].price_per_hour_usd == 2 * cat.offers[0].price_per_instance_hour_usd


def test_local_order_is_sized_from_one_process_lines_only(tmp_path):
    from planner.decisions.pipeline import make_plan
    from planner.outputs.orders import local_order

    camp = load_campaign_text(campaign_yaml(), "t")
    # a larger configuration than any one-process line, far below their memory: it must not be taken
    ranks = pilot_lines(config(micro_batch=8, seq_len=256, eval_seq_len=256, eval_micro_batch=8, strategy="fsdp",
                               world_size=8, mode="estimated"), 1 * MiB)
    plain = ledger(tmp_path)
    (tmp_path / "b").mkdir()
    mixed = ledger(tmp_path / "b", extra=ranks)
    orders = [local_order(camp, make_plan(camp, lines, CATALOG), 0.10) for lines in (plain, mixed)]
    assert orders[0]["plan"]["need_bytes"] == orders[1]["plan"]["need_bytes"]
    settings = orders[1]["settings"]
    assert orders[0]["settings"] == settings
    assert settings["micro_batch"] * settings["grad_accum"] == camp.effective_batch  # the campaign's shape


@pytest.mark.parametrize("measured_on, h100_extra, a100_extra", [
    (None, 66 * MiB, 22 * MiB),  # CPU lines hold no workspace: each GPU's own, two threads' worth
    ("NVIDIA H100 80GB HBM3", 0, 0),  # in the lines' reserved peaks already; an A100's are smaller
    ("NVIDIA A100-SXM4-40GB", 44 * MiB, 0),  # sm90's 32 MiB cuBLAS workspace against 8 MiB, for each thread
])
def test_the_context_adds_the_blas_workspaces_the_lines_do_not_hold(tmp_path, measured_on, h100_extra, a100_extra):
    camp = load_campaign_text(campaign_yaml(), "t")
    lines = []
    for mb, seq in [(1, 128), (2, 128), (1, 256), (4, 256)]:
        cfg = config(micro_batch=mb, seq_len=seq, eval_seq_len=seq, eval_micro_batch=mb)
        cuda = {} if measured_on is None else {"reserved": True, "device": "cuda:0", "device_name": measured_on}
        lines += pilot_lines(cfg, 100 * MiB + mb * seq * 50_000, **cuda)
    sheet = select(camp, read_lines(write_ledger(tmp_path / "l.db", lines)), CATALOG,
                   offers=[offer(id="h100", gpus=1), offer(id="a100", gpus=1, gpu="a100_40gb")])
    for offer_id, extra in (("h100", h100_extra), ("a100", a100_extra)):
        r = row(sheet, offer_id)
        assert r["context_bytes"] - CATALOG.context_bytes == extra, offer_id
        said = f"BLAS workspaces {extra // MiB} MiB"
        assert (said in r["context_basis"]) == (extra > 0), r["context_basis"]


def test_the_users_own_loop_of_one_process_is_planned_on_one_gpu(tmp_path):
    """User (#44): lines from their own loop (an HF Trainer callback, world size 1) were planned "ddp × 8" on an
    8-GPU offer. rentplan cannot make that loop data-parallel: the offer is planned on one GPU, says it needs the
    loop to run DDP, and is never recommended nor ★; the same lines from rentplan's own probe still get DDP."""
    import dataclasses

    from planner.decisions.pipeline import make_plan
    from planner.records import OBSERVED_PHASES

    full = []
    for mb, seq in [(1, 128), (2, 128), (1, 256), (4, 256)]:
        cfg = config(workload="trainer:my-bert", micro_batch=mb, seq_len=seq, eval_seq_len=seq, eval_micro_batch=mb)
        full += pilot_lines(cfg, 100 * MiB + mb * seq * 50_000, flops_per_update=1e15)
    # what the callback writes: the phases the user's loop went through, one process
    own = [dataclasses.replace(x, source="hf-trainer") for x in full if x.phase in OBSERVED_PHASES]
    lines = read_lines(write_ledger(tmp_path / "l.db", own))
    camp = load_campaign_text(campaign_yaml(workload="trainer:my-bert"), "t")
    offers = [offer(id="h100-1x", gpus=1, price_per_instance_hour_usd=40.0), offer(id="h100-8x")]
    sheet = select(camp, lines, CATALOG, offers=offers)
    eight = row(sheet, "h100-8x")
    assert eight["strategy"] == "single" and eight["replicas"] == 1 and eight["idle_gpus"] == 7
    assert eight["strategy_label"] == "single; needs your loop to run DDP"
    assert "hf-trainer" in eight["strategy_why"] and "one process" in eight["strategy_why"]
    assert eight["update_s_high"] == row(sheet, "h100-1x")["update_s_high"]  # one GPU's time, not 8 replicas'
    assert row(sheet, "h100-1x")["recommended"]  # though the 8-GPU offer is cheaper per hour here
    cat = dataclasses.replace(CATALOG, offers=offers)
    result = make_plan(camp, lines, cat)
    assert not result.plans[result.plans["offer"] == "h100-8x"]["cheapest_for_priority_1"].any()
    with pytest.raises(Exception, match="needs your loop to run DDP"):
        make_plan(camp, lines, cat, offer_id="h100-8x")
    # only multi-GPU offers: nothing is ordered, and stdout and the sheet say why (not "no offer fits")
    from planner.api import decision_text
    from planner.outputs.render import build_context, render_template

    alone = make_plan(camp, lines, dataclasses.replace(CATALOG, offers=[offer(id="h100-8x")]))
    said = decision_text(alone.sheet)
    assert "no offer fits" not in said and "needs your loop to run DDP" in said and "one-GPU offer" in said
    sheet_md = render_template("order_sheet.md.j2", {
        **build_context(camp, alone.sheet, alone.plans, alone.budget, alone.lines, CATALOG, 0.10),
        "figures": [], "figures_note": "", "verify_command": "rentplan verify out/order.json"})
    assert "No offer fits" not in sheet_md and "needs your loop to run DDP" in sheet_md
    (tmp_path / "p").mkdir()  # the same lines written by rentplan's probe: DDP as before
    probed = read_lines(write_ledger(tmp_path / "p" / "l.db", full))
    assert row(select(camp, probed, CATALOG, offers=offers), "h100-8x")["strategy"] == "ddp"
