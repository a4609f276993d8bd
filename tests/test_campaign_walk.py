"""A campaign run walks straight (#46 item 4): the spec is answered once, into a CampaignRun, and the run never
calls back into the spec module; the stop rule is a pure function of the update's loss."""

import sys

import pytest
import yaml

from planner.inputs.campaign_spec import CampaignRun, StopRules, campaign_run, load_campaign, load_campaign_text
from tests.conftest import TINY
from tests.factories import campaign_yaml

RULES = StopRules(diverge_above=10.0, on_divergence=True, loss_above=None)


def test_the_stop_rule_goes_on_below_the_divergence_threshold():
    from probes.campaign import Verdict, stop_rule

    assert stop_rule(2.0, 2.0, False, RULES) == Verdict()
    assert stop_rule(19.9, 2.0, False, RULES) == Verdict()
    assert stop_rule(5.0, None, False, RULES) == Verdict()  # no first loss yet: nothing to compare with
    assert stop_rule(50.0, 0.0, False, RULES) == Verdict()  # a first loss of 0 is no reference


def test_the_stop_rule_ends_a_run_that_diverges_unless_told_to_run_on():
    from probes.campaign import Verdict, stop_rule

    why = "loss 21 above 10 × the first loss 2"
    assert stop_rule(21.0, 2.0, False, RULES) == Verdict(diverged=why, outcome="diverged")
    assert stop_rule(float("nan"), 2.0, False, RULES) == Verdict(diverged="non-finite loss", outcome="diverged")
    runs_on = StopRules(10.0, on_divergence=False, loss_above=None)
    assert stop_rule(21.0, 2.0, False, runs_on) == Verdict(diverged=why)
    assert stop_rule(30.0, 2.0, True, runs_on) == Verdict()  # said once, at the first update that diverged


def test_the_stop_rule_stops_a_loss_above_the_limit_and_keeps_a_divergence_in_the_outcome():
    from probes.campaign import Verdict, stop_rule

    capped = StopRules(10.0, on_divergence=False, loss_above=8.0)
    assert stop_rule(9.0, 2.0, False, capped) == Verdict(stopped="loss 9 above stop_if.loss_above 8.0",
                                                         outcome="stopped")
    assert stop_rule(9.0, 2.0, True, capped).outcome == "diverged"  # it diverged earlier and ran on
    both = stop_rule(25.0, 2.0, False, capped)
    assert both.diverged and both.stopped and both.outcome == "diverged"
    assert stop_rule(7.0, 2.0, False, capped) == Verdict()


def test_a_campaign_run_is_the_spec_answered_into_plain_values(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(campaign_yaml(workload="wl.py:make", params={"data": "d.jsonl", "layers": 1}, micro_batch=4,
                                  stop_if={"diverged": False, "loss_above": 9.0}, diverge_above=5,
                                  export="adapter", variants=[
                                      {"id": "control", "lr": 1e-4},
                                      {"id": "small", "lr": 1e-4, "micro_batch": 2, "checkpointing": True,
                                       "priority": 2, "seed": 3}]))
    camp = load_campaign(spec)
    run = campaign_run(camp)
    assert isinstance(run, CampaignRun)
    assert run.workload == f"{tmp_path}/wl.py:make" and run.params["data"] == f"{tmp_path}/d.jsonl"
    assert run.rules == StopRules(5.0, False, 9.0) and run.stop_if == {"nonfinite": True, "diverged": False,
                                                                        "loss_above": 9.0}
    assert run.export_adapter and run.control == "control" and run.save_every == camp.save_every
    control, small = run.variants
    assert (control.micro_batch, control.checkpointing, control.precision, control.changes) == (4, False, "bf16", {})
    assert (small.micro_batch, small.checkpointing, small.seed, small.priority) == (2, True, 3, 2)
    assert small.changes == {"micro_batch": 2, "checkpointing": True}
    assert [v.id for v in campaign_run(camp, camp.variants[1:]).variants] == ["small"]


def test_the_same_configuration_as_before_the_spec_was_answered_once():
    from probes.campaign import variant_config

    camp = load_campaign_text(campaign_yaml(micro_batch=None), "c.yaml")
    run = campaign_run(camp)
    cfg = variant_config(run, run.variants[0], "cpu", world=2, strategy="ddp")
    assert (cfg.micro_batch, cfg.grad_accum, cfg.world_size, cfg.strategy) == (8, 1, 2, "ddp")
    assert (cfg.seq_len, cfg.eval_seq_len, cfg.lr, cfg.precision) == (256, 256, 1e-4, "bf16")
    with pytest.raises(ValueError, match="does not split over 3"):
        variant_config(run, run.variants[0], "cpu", world=3)


def test_a_run_never_calls_back_into_the_spec_module(tmp_path):
    """The walk the issue counted (nine call sites, 30 calls for two variants of four updates): one call now,
    campaign_run at the start."""
    from probes import campaign as pc

    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "c", "workload": "builtin:gpt", "params": TINY, "precision": "fp32", "seq_len": 8,
        "effective_batch": 2, "updates": 2, "eval": {"every_updates": 1, "examples": 2, "seq_len": 8},
        "setup_hours": 0.1, "variants": [{"id": "control", "lr": 1e-3}, {"id": "b", "lr": 2e-3}]}))
    camp = load_campaign(spec)
    calls = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("campaign_spec.py") and frame.f_back is not None \
                and frame.f_back.f_code.co_filename.endswith("probes/campaign.py"):
            calls.append(frame.f_code.co_name)

    sys.setprofile(watch)
    try:
        outcomes = pc.run_campaign(camp, camp.variants, None, str(tmp_path / "l.db"), str(tmp_path / "runs"),
                                   "cpu", None, "single", say=lambda m: None, echo=lambda m: None)
    finally:
        sys.setprofile(None)
    assert outcomes == ["finished", "finished"]
    assert calls == ["campaign_run"]
