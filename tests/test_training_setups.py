"""The setups people rent GPUs for: pure bf16 (bf16-true), 8-bit AdamW, Adafactor; Lightning's precision names.
Each is measured on this CPU and estimated under fake tensors, and the two must agree."""

import json

import pytest

from planner.decisions.select import choose_precision
from planner.inputs.campaign_spec import load_campaign_text
from planner.inputs.catalog import load_catalog
from planner.inputs.grid import GridSpec, build_grid
from planner.records import ProbeConfig
from tests.factories import campaign_yaml

torch = pytest.importorskip("torch")
from probes.pilot import Pilot  # noqa: E402

GPT = {"layers": 2, "d_model": 128, "heads": 4, "vocab": 512}


def first_step(**kw):
    cfg = ProbeConfig(workload="builtin:gpt", params_json=json.dumps(GPT, sort_keys=True), micro_batch=2, seq_len=32,
                      eval_seq_len=32, **kw)
    out = {}
    Pilot(cfg, "/nonexistent", lambda k, x: out.__setitem__(x["phase"], x) if k == "line" else None, "r", "p").run(
        ("setup", "first_step"))
    assert [v["verdict"] for v in out.values()] == ["ok", "ok"], out
    return out["setup"], out["first_step"]


def per_param(setup, step):
    n = setup["trainable_param_count"]
    return setup["param_bytes"] / setup["param_count"], step["optimizer_state_bytes"] / n


@pytest.mark.parametrize("mode", ["measured", "estimated"])
def test_bf16_true_adamw_keeps_weights_2_bytes_and_state_4_bytes_per_parameter(mode):
    params, state = per_param(*first_step(precision="bf16-true", mode=mode))
    assert params == 2.0
    assert state == pytest.approx(4.0, rel=1e-3)  # two bf16 moments (+ one step scalar per tensor)


@pytest.mark.parametrize("mode", ["measured", "estimated"])
def test_adamw8bit_state_is_about_2_bytes_per_trainable_parameter(mode):
    pytest.importorskip("bitsandbytes")
    _, state = per_param(*first_step(optimizer="adamw8bit", mode=mode))
    assert state == pytest.approx(2.0, rel=0.10)  # two uint8 moments, a float32 absmax per 256 (small tensors 32-bit)


@pytest.mark.parametrize("mode", ["measured", "estimated"])
def test_adafactor_state_is_below_half_a_byte_per_parameter(mode):
    _, state = per_param(*first_step(optimizer="adafactor", mode=mode))
    assert state < 0.5  # a row and a column vector per matrix instead of two full moments


@pytest.mark.parametrize("kw", [{"precision": "bf16-true"}, {"optimizer": "adamw8bit"}, {"optimizer": "adafactor"}])
def test_estimate_matches_the_measurement_on_this_cpu(kw):
    if kw.get("optimizer") == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    measured = first_step(**kw)
    estimated = first_step(mode="estimated", **kw)
    for phase in (0, 1):
        assert estimated[phase]["peak_allocated_bytes"] == measured[phase]["peak_allocated_bytes"], phase
    assert estimated[1]["optimizer_state_bytes"] == measured[1]["optimizer_state_bytes"]


def test_lightning_precision_names_are_accepted_and_recorded_as_rentplan_names():
    camp = load_campaign_text(campaign_yaml(precision="bf16-mixed", variants=[
        {"id": "control", "lr": 1e-4, "priority": 1},
        {"id": "pure", "lr": 1e-4, "priority": 2, "precision": "bf16-true"},
        {"id": "full", "lr": 1e-4, "priority": 2, "precision": "32-true"}]), "c.yaml")
    assert camp.precision == "bf16"
    assert [camp.setting(v, "precision") for v in camp.variants] == ["bf16", "bf16-true", "fp32"]
    grid = build_grid(GridSpec(precision=["32-true", "16-mixed", "bf16-true"]))
    assert [c.precision for c in grid] == ["fp32", "fp16", "bf16-true"]


def test_bf16_true_runs_fp32_where_there_is_no_bf16():
    cat = load_catalog(None)
    assert choose_precision(cat.gpu("a100_80gb_sxm"), "bf16-true")[0] == "bf16-true"
    precision, why = choose_precision(cat.gpu("v100_32gb"), "bf16-true")
    assert precision == "fp32" and "sm_80+" in why
    assert cat.gpu("h100_sxm").peak_tflops("bf16-true") == cat.gpu("h100_sxm").peak_tflops("bf16")


def test_fused_adamw_has_no_parameter_sized_temporary_that_foreach_has():
    """AdamW as CUDA runs it: foreach (torch's default) keeps a list of parameter-sized temporaries (the moments'
    square roots) during the step; fused does the update in one kernel per group without them."""
    setup, foreach = first_step(optimizer="adamw")
    _, fused = first_step(optimizer="adamw_fused")
    extra = foreach["peak_allocated_bytes"] - fused["peak_allocated_bytes"]
    assert extra == pytest.approx(setup["param_bytes"], rel=0.05)
    assert fused["optimizer_state_bytes"] == foreach["optimizer_state_bytes"]
    estimated = first_step(optimizer="adamw_fused", mode="estimated")[1]
    assert estimated["peak_allocated_bytes"] == fused["peak_allocated_bytes"]
