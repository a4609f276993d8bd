"""QLoRA: an hf: model's linears in 4 bits (bitsandbytes nf4/fp4, double-quantized absmax), LoRA on top.
Measured on this CPU with bitsandbytes' own layers; estimated with the same layer holding the same tensors
(probes/quantize.py), checked against the measurement; an 8B shape planned for a 24 GB card."""

import contextlib
import json

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.ledger import read_lines
from planner.records import ProbeConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
from probes.memory import LiveTensorTracker  # noqa: E402
from probes.pilot import Pilot  # noqa: E402
from probes.quantize import _fake_layer, _real_layer, quantized_bytes  # noqa: E402
from tests.factories import tiny_llama  # noqa: E402

LORA = "r=8,alpha=16,targets=q_proj+v_proj"


@pytest.fixture
def llama(tmp_path):
    return tiny_llama(tmp_path / "llama", width=256, vocab=512)  # wide enough for several absmax blocks


def layer_memory(kind, fake):
    """A 512×256 linear quantized, then forward and backward under autocast: (forward peak, peak, kept)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _real_layer(torch.nn.Linear(64, 64), kind, torch.device("cpu"))  # bitsandbytes caches a table on first use
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        tracker = LiveTensorTracker()
        with tracker:
            lin = torch.nn.Linear(256, 512, bias=True, device="meta" if fake else "cpu")
            layer = (_fake_layer if fake else _real_layer)(lin, kind, torch.device("cpu"))
            held = tracker.live
            x = torch.randn(2, 32, 256, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                base = tracker.live
                tracker.reset_peak()
                y = layer(x)
                forward = tracker.peak - base
                y.float().sum().backward()
            return held, forward, tracker.peak - base, tracker.live - base


@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_estimated_layer_holds_and_allocates_what_bitsandbytes_does(kind):
    real, fake = layer_memory(kind, fake=False), layer_memory(kind, fake=True)
    assert fake == real  # weights + quant state held; forward, backward peak and what stays, byte for byte


def pilot(llama, mode, params, phases=("setup", "first_step")):
    cfg = ProbeConfig(workload=f"hf:{llama}", params_json=json.dumps(params, sort_keys=True), micro_batch=2, seq_len=32,
                      eval_seq_len=32, precision="bf16", mode=mode)
    out = {}
    p = Pilot(cfg, "/nonexistent", lambda k, x: out.__setitem__(x["phase"], x) if k == "line" else None, "r", "p")
    p.run(phases)
    assert all(v["verdict"] == "ok" for v in out.values()), out
    return out, p.trainer.model


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["measured", "estimated"])
def test_nf4_base_is_half_a_byte_per_quantized_parameter_and_lora_trains_the_same(llama, mode):
    out, model = pilot(llama, mode, {"lora": LORA, "quantize": "nf4"})
    q = quantized_bytes(model)
    assert q["packed_bytes"] == q["quantized_params"] // 2  # two 4-bit values per byte
    # absmax per 64 in 8 bits, plus its float32 absmax per 256 and the tables: well under 0.05 B/param
    assert 0 < q["stats_bytes"] < 0.05 * q["quantized_params"]
    plain, _ = pilot(llama, mode, {"lora": LORA})
    assert out["setup"]["trainable_param_count"] == plain["setup"]["trainable_param_count"]
    assert out["setup"]["param_count"] < plain["setup"]["param_count"]  # packed: two values per stored byte
    assert out["first_step"]["optimizer_state_bytes"] == plain["first_step"]["optimizer_state_bytes"]


def test_quantize_needs_lora(llama, tmp_path):
    r = CliRunner().invoke(cli, ["probe", "-w", f"hf:{llama}", "--quantize", "nf4", "--ledger", str(tmp_path / "l.db")])
    assert r.exit_code == 1 and "quantize needs lora" in r.output


@pytest.mark.parametrize("mode", ["measured", "estimated"])
def test_int8_base_is_a_byte_per_quantized_parameter(llama, mode):
    _, model = pilot(llama, mode, {"lora": LORA, "quantize": "int8"})
    q = quantized_bytes(model)
    assert q["packed_bytes"] == q["quantized_params"]  # int8 rows
    assert q["stats_bytes"] > 0  # a float32 scale per row


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_resumes_exactly(llama, kind):
    r = CliRunner().invoke(cli, ["resume-check", "-w", f"hf:{llama}", "-p", f"lora={LORA}", "-p", f"quantize={kind}",
                                 "--precision", "bf16", "--updates", "4", "--at", "2"])
    assert r.exit_code == 0, r.output
    assert "resume is exact" in r.output


SPEC = """name: llama3-8b-qlora
workload: hf:llama-3-8b
params: {lora: "r=16,alpha=32,targets=q_proj+k_proj+v_proj+o_proj", quantize: nf4}
precision: bf16
seq_len: 1024
effective_batch: 16
updates: 500
eval: {every_updates: 100, examples: 128, seq_len: 2048, micro_batch: 1}
export: adapter
setup_hours: 1
variants:
  - {id: control, lr: 2.0e-4, priority: 1}
"""


@pytest.mark.slow
def test_8b_qlora_is_planned_for_a_24_gb_card_from_its_estimate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                             rope_theta=500000.0, architectures=["LlamaForCausalLM"]).save_pretrained("llama-3-8b")
    (tmp_path / "qlora.yaml").write_text(SPEC)
    r = CliRunner().invoke(cli, ["estimate", "-w", "hf:llama-3-8b", "--lora",
                                 "r=16,alpha=32,targets=q_proj+k_proj+v_proj+o_proj", "--quantize", "nf4",
                                 "--precision", "bf16", "--micro-batch", "1,2", "--seq-len", "1024",
                                 "--eval-seq-len", "2048", "--eval-micro-batch", "1", "--target", "sm80+",
                                 "--ledger", "l.db"])
    assert r.exit_code == 0, r.output
    setup = read_lines(tmp_path / "l.db").query("phase == 'setup'").iloc[0]
    # 7.0 B quantized parameters at ~0.5 B + embeddings and head in bf16 (2 × 0.53 B parameters × 2 B)
    assert 5.0 * 2**30 < setup["peak_allocated_bytes"] < 5.8 * 2**30
    # export: adapter ships the adapter alone: 4 targets × 32 layers × r 16 × (4096 + in/out widths), fp32
    export = read_lines(tmp_path / "l.db").query("phase == 'export'").iloc[0]
    adapter = 32 * 16 * 4 * (2 * (4096 + 4096) + 2 * (4096 + 1024))
    assert export["checkpoint_bytes"] == adapter, (export["checkpoint_bytes"], adapter)
    r = CliRunner().invoke(cli, ["plan", "--campaign", "qlora.yaml", "--ledger", "l.db", "--out", "out",
                                 "--offer", "vast-rtx_4090-1x"])
    assert r.exit_code == 0, r.output
    order = json.loads((tmp_path / "out" / "order.json").read_text())
    s = order["settings"]
    assert (s["seq_len"], s["micro_batch"] * s["grad_accum"]) == (1024, 16) and s["micro_batch"] >= 1
    assert order["plan"]["need_bytes"] < 24 * 10**9
    sheet = (tmp_path / "out" / "order_sheet.md").read_text()
    assert "**Base:** base weights quantized: the linear layers in 4-bit nf4" in sheet
    import pandas as pd

    row = pd.read_csv(tmp_path / "out" / "selection.csv").set_index("offer").loc["vast-rtx_4090-1x"]
    assert row["verdict"] in ("fits", "tight") and row["seq_len"] == 1024  # the sheet states both
    assert (row["micro_batch"], row["grad_accum"]) == (s["micro_batch"], s["grad_accum"])
    html = (tmp_path / "out" / "order_sheet.html").read_text()  # the cheap 24 GB cards are rows of the HTML table
    for offer in ("vast-rtx_4090-1x", "vast-rtx_3090-2x"):
        assert f'<td class="sticky">{offer}</td>' in html, offer


# What bitsandbytes holds depends on its version (probes/quantize.py, BnbSemantics, with sources).
def test_bitsandbytes_versions_and_what_their_matmul_keeps():
    from probes.quantize import BnbSemantics

    old, fixed, fused = BnbSemantics.of("0.42.0"), BnbSemantics.of("0.43.2"), BnbSemantics.of("0.50.0")
    assert old.saves_input and old.dequantizes_forward  # 0.42.0 _functions.py:516, :523
    assert not fixed.saves_input and fixed.dequantizes_forward  # PR #1270 (9e753741), first in 0.43.2
    assert not fused.saves_input and not fused.dequantizes_forward  # gemm_4bit (#1949), first in 0.50.0
    assert BnbSemantics.of("0.41.1").saves_input and not BnbSemantics.of("0.44.1").saves_input


@pytest.mark.slow  # 3.1 s: an estimate of a quantized model
def test_an_old_bitsandbytes_holds_each_4bit_input_and_the_line_says_what_the_loop_may_add(llama):
    """litgpt pinned bitsandbytes 0.42.0: its MatMul4Bit keeps every 4-bit layer's input on the graph node, and
    litgpt's loop keeps the last step's logits into the next forward, so the previous step's inputs are held too.
    The estimate holds them (the larger need) and its steady line names them with their bytes."""
    lora = {"lora": LORA, "quantize": "nf4"}
    phases = ("setup", "first_step", "steady")
    now, _ = pilot(llama, "estimated", lora, phases)
    old, _ = pilot(llama, "estimated", {**lora, "bnb": "0.42.0"}, phases)
    assert old["setup"]["peak_allocated_bytes"] == now["setup"]["peak_allocated_bytes"]  # same weights
    assert old["first_step"]["peak_allocated_bytes"] > now["first_step"]["peak_allocated_bytes"]  # inputs kept
    held = old["steady"]["baseline_allocated_bytes"] - now["steady"]["baseline_allocated_bytes"]
    assert held > 0  # the previous step's inputs, alive before the next forward
    assert "bitsandbytes < 0.43.2 keeps each 4-bit layer's input" in old["steady"]["detail"]
    assert "traced as bitsandbytes 0.42.0's MatMul4Bit" in old["steady"]["detail"]
    assert "0.43.2" not in now["steady"]["detail"]


def test_lightning_style_quantization_head_and_no_double_quant(llama):
    """Lightning's BitsandbytesPrecision (litgpt) quantizes the head too and, in nf4 mode, keeps a float32 absmax
    per 64 (no double quantization): 1/16 byte per parameter of statistics instead of about 1/64."""
    base = {"lora": LORA, "quantize": "nf4"}
    _, dq = pilot(llama, "estimated", base, ("setup",))
    _, lit = pilot(llama, "estimated", {**base, "quant_head": True, "double_quant": False, "quant_from": "float16"},
                   ("setup",))
    q_dq, q_lit = quantized_bytes(dq), quantized_bytes(lit)
    assert q_lit["quantized_params"] > q_dq["quantized_params"]  # the head is quantized too
    assert q_lit["stats_bytes"] >= q_lit["quantized_params"] // 16  # float32 absmax per 64
    assert q_dq["stats_bytes"] < q_dq["quantized_params"] // 32


def test_a_measured_run_refuses_a_bitsandbytes_it_does_not_have(llama):
    """A measured line is what the installed bitsandbytes kept: asking it to be 0.42.0's is an error on the line."""
    cfg = ProbeConfig(workload=f"hf:{llama}",
                      params_json=json.dumps({"lora": LORA, "quantize": "nf4", "bnb": "0.42.0"}),
                      micro_batch=2, seq_len=32, eval_seq_len=32, precision="bf16", mode="measured")
    out = {}
    Pilot(cfg, "/nonexistent", lambda k, x: out.__setitem__(x["phase"], x) if k == "line" else None, "r", "p"
          ).run(("setup",))
    assert out["setup"]["verdict"] == "error"
    assert "install bitsandbytes==0.42.0 to measure it" in out["setup"]["detail"]


def test_quantizer_options_need_quantize(llama, tmp_path):
    r = CliRunner().invoke(cli, ["estimate", "-w", f"hf:{llama}", "-p", f"lora={LORA}", "-p", "bnb=0.42.0",
                                 "--ledger", str(tmp_path / "l.db")])
    assert r.exit_code == 1 and "give quantize=nf4|fp4 too" in r.output


def test_qlora_switches_and_versions_are_read_as_written_or_refused():
    """A fresh-clone user (#43's attack): `-p quant_head=maybe` and `double_quant=nope` were read as true (bool of
    a string: other bytes, silently) and `bnb=0.1` (before bitsandbytes had 4-bit weights) was taken. A switch is
    true/false (yes/no, on/off, 1/0) or refused by name; a version before 0.39.0 is refused."""
    pytest.importorskip("bitsandbytes")
    from planner.errors import WorkloadError
    from probes.hf import _quant_options

    for value, meant in (("false", False), ("0", False), ("no", False), (True, True), ("yes", True), (1, True)):
        assert _quant_options("nf4", None, value, value, "bfloat16").head is meant
        assert _quant_options("nf4", None, False, value, "bfloat16").double_quant is meant
    for name, args in (("quant_head", ("maybe", True)), ("double_quant", (False, "nope")),
                       ("double_quant", (False, 2))):
        with pytest.raises(WorkloadError, match=name):
            _quant_options("nf4", None, *args, "bfloat16")
    with pytest.raises(WorkloadError, match="0.39.0"):
        _quant_options("nf4", "0.1", False, True, "bfloat16")
    assert _quant_options("nf4", "0.42.0", False, True, "bfloat16").bnb == "0.42.0"
