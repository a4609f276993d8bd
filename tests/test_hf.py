"""hf: workloads: a tiny Llama config written by the test, LoRA through peft, the user's own JSONL data."""

import json

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.ledger import read_lines
from planner.records import PHASES, ProbeConfig

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
from probes.pilot import TRAIN_WORKER_PHASES, Pilot  # noqa: E402
from tests.factories import tiny_llama  # noqa: E402

LORA = "r=8,alpha=16,targets=q_proj+v_proj"


@pytest.fixture
def llama(tmp_path):
    return tiny_llama(tmp_path / "llama")


def pilot(tmp_path, ref, params, phases=TRAIN_WORKER_PHASES, **kw):
    cfg = ProbeConfig(workload=ref, params_json=json.dumps(params, sort_keys=True), micro_batch=2, seq_len=32,
                      eval_seq_len=64, **kw)
    out = {}
    p = Pilot(cfg, str(tmp_path), lambda k, x: out.__setitem__(x["phase"], x) if k == "line" else None, "r-hf", "p")
    p.run(phases)
    return out, p


@pytest.mark.slow
def test_tiny_llama_probes_through_all_phases(tmp_path, llama):
    ledger = str(tmp_path / "l.db")
    r = CliRunner().invoke(cli, ["probe", "-w", f"hf:{llama}", "--seq-len", "32", "--ledger", ledger,
                                 "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    df = read_lines(ledger)
    assert list(df["phase"]) == list(PHASES) and (df["verdict"] == "ok").all(), df[["phase", "detail"]]
    # the model code that ran is on every line (#43: HF's code version moves memory)
    assert all(f"transformers {transformers.__version__}" in x for x in df["libraries"]), set(df["libraries"])


@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_an_estimated_lora_export_is_the_adapter_as_a_measured_one_is(tmp_path, llama):
    """User: a tiny Llama with --lora measured an export of 116,712 bytes (the adapter) and estimated one of
    28,500,992 ("weights size"): the sheet then timed a QLoRA export of 5.36 GiB instead of tens of MB."""
    (tmp_path / "m").mkdir(), (tmp_path / "e").mkdir()
    measured, _ = pilot(tmp_path / "m", f"hf:{llama}", {"lora": LORA})
    estimated, _ = pilot(tmp_path / "e", f"hf:{llama}", {"lora": LORA}, mode="estimated")
    real, est = measured["export"]["checkpoint_bytes"], estimated["export"]["checkpoint_bytes"]
    assert est <= real <= est + 4096, (real, est)  # the tensors; the file adds its JSON header
    assert "adapter" in estimated["export"]["detail"]


@pytest.mark.slow
def test_lora_optimizer_state_is_exactly_the_adapters(tmp_path, llama):
    lines, p = pilot(tmp_path, f"hf:{llama}", {"lora": LORA})
    trainable = [q for q in p.trainer.model.parameters() if q.requires_grad]
    frozen = [q for q in p.trainer.model.parameters() if not q.requires_grad]
    assert trainable and frozen
    adapter_bytes = sum(q.numel() * q.element_size() for q in trainable)
    state = lines["first_step"]["optimizer_state_bytes"]
    assert state == 2 * adapter_bytes + 4 * len(trainable)  # exp_avg, exp_avg_sq, one fp32 step each
    grown = lines["steady"]["baseline_allocated_bytes"] - lines["first_step"]["baseline_allocated_bytes"]
    assert grown == state  # the frozen base adds no gradients or state that outlive the update
    assert lines["setup"]["trainable_param_count"] == sum(q.numel() for q in trainable)


@pytest.mark.slow
def test_lora_export_writes_only_the_adapter_and_it_reloads(tmp_path, llama):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from probes.workloads import load_workload

    lines, p = pilot(tmp_path, f"hf:{llama}", {"lora": LORA})
    path = tmp_path / "r-hf.model.safetensors"
    tensors = load_file(str(path))
    assert tensors and all("lora_" in k for k in tensors)
    assert lines["export"]["checkpoint_bytes"] == path.stat().st_size
    import torch
    from peft import get_peft_model_state_dict

    fresh = load_workload(f"hf:{llama}", {"lora": LORA}).build_model()
    set_peft_model_state_dict(fresh, tensors)
    back = get_peft_model_state_dict(fresh)
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)  # the adapter reloads exactly


def write_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "unk_token": "<unk>", "pad_token": "<pad>",
                                                            "eos_token": "</s>"}))


@pytest.mark.slow
def test_p99_length_of_the_data_drives_the_lengths(tmp_path, llama):
    write_tokenizer(llama)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(200):
            n = 10 + (i % 20) if i != 7 else 150  # one very long example: the p99 must not be it
            f.write(json.dumps({"prompt": " ".join(f"w{j % 200}" for j in range(n // 2)),
                                "response": " ".join(f"w{j % 200}" for j in range(n - n // 2))}) + "\n")
    ledger = str(tmp_path / "l.db")
    r = CliRunner().invoke(cli, ["probe", "-w", f"hf:{llama}", "--data", str(data), "--fields", "prompt,response",
                                 "--ledger", ledger, "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    df = read_lines(ledger)
    assert (df["verdict"] == "ok").all()
    assert set(df["eval_seq_len"]) == {151}  # the longest example (150 tokens + end of sequence)
    assert set(df["seq_len"]) == {30}  # its 99th percentile
    assert "p99 length 30 tokens" in r.output and "the longest (151)" in r.output


def test_inspect_shows_masked_prompt_of_own_data(tmp_path, llama):
    write_tokenizer(llama)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "w1 w2 w3", "response": "w4 w5"}) + "\n")
    r = CliRunner().invoke(cli, ["inspect", "-w", f"hf:{llama}", "-p", f"data={data}", "-n", "1", "--seq-len", "8",
                                 "--split", "val"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "w1 w2 w3 w4 w5" in r.output and "mask: ...xxx.." in r.output


def test_inspect_knows_a_sequence_classifier_has_no_prompt(tmp_path):
    """User (#44): `inspect -w hf:…` of a BERT sequence classifier warned "prompt tokens are masked, but every
    position is counted in the loss" (a classifier has no prompt) and --strict exited 1."""
    path = tmp_path / "bert-cls"
    transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=256, num_labels=3,
                            architectures=["BertForSequenceClassification"]).save_pretrained(path)
    r = CliRunner().invoke(cli, ["inspect", "-w", f"hf:{path}", "-n", "2", "--seq-len", "16", "--strict"])
    assert r.exit_code == 0, r.output
    assert "prompt" not in r.output and "no masking problems found" in r.output
    assert "task: classification; model outputs: 3 classes" in r.output


@pytest.mark.slow
def test_sequence_classification_config_probes_through_all_phases(tmp_path):
    path = tmp_path / "cls"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, num_labels=3, pad_token_id=0,
                             architectures=["LlamaForSequenceClassification"]).save_pretrained(path)
    lines, p = pilot(tmp_path, f"hf:{path}", {"lora": LORA})
    assert p.workload.task == "classification"
    assert all(x["verdict"] == "ok" for x in lines.values()), {k: x["detail"] for k, x in lines.items()}
    batch = p.workload.make_batch("train", 0, 2, 16)
    assert batch["labels"].shape == (2,) and int(batch["labels"].max()) < 3


@pytest.mark.slow
def test_campaign_with_adapter_export_ships_the_adapter_and_finishes(tmp_path, llama):
    from safetensors import safe_open

    spec = tmp_path / "c.yaml"
    spec.write_text(f"""
name: lora-run
workload: hf:{llama}
params: {{lora: "{LORA}"}}
seq_len: 32
effective_batch: 4
micro_batch: 2
updates: 4
eval: {{every_updates: 2, examples: 4, seq_len: 32}}
precision: fp32
export: adapter
variants:
  - {{id: control, lr: 1.0e-3}}
""")
    led, out = str(tmp_path / "l.db"), str(tmp_path / "runs")
    r = CliRunner().invoke(cli, ["campaign", "run", str(spec), "--ledger", led, "--out", out], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    run_id = r.stdout.split()[0]
    with safe_open(f"{out}/{run_id}/model.safetensors", "pt") as f:
        assert all("lora_" in k for k in f.keys())
    r = CliRunner().invoke(cli, ["campaign", "finish", run_id, "--ledger", led, "--out", out], catch_exceptions=False)
    assert r.exit_code == 0 and "reproduces the control outputs" in r.output, r.output


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def qa(n_prompt, n_response, start=0):
    return {"prompt": " ".join(f"w{(start + j) % 200}" for j in range(n_prompt)),
            "response": " ".join(f"w{(start + 7 + j) % 200}" for j in range(n_response))}


@pytest.mark.slow
def test_long_examples_are_counted_and_the_on_truncate_choice_is_kept(tmp_path, llama):
    """A user's data with 3 of 40 examples longer than seq_len: warn says so; drop leaves them out of every
    batch; error refuses before any worker starts."""
    from probes.hf import HFWorkload

    write_tokenizer(llama)
    data = tmp_path / "train.jsonl"
    write_rows(data, [qa(4, 40 if i in (3, 17, 30) else 6, i) for i in range(40)])
    led = str(tmp_path / "l.db")
    common = ["probe", "-w", f"hf:{llama}", "--data", str(data), "--seq-len", "16", "--eval-seq-len", "64",
              "--micro-batch", "2", "--ledger", led, "--device", "cpu"]
    r = CliRunner().invoke(cli, common, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "is longer than seq_len 16" in r.output or "are longer than seq_len 16" in r.output
    assert "on_truncate=warn" in r.output and "not the same experiment" in r.output
    r = CliRunner().invoke(cli, [*common, "--on-truncate", "error"])
    assert r.exit_code == 1 and "Error: " in r.output and "on_truncate=error" in r.output
    wl = HFWorkload(str(llama), data=str(data), on_truncate="drop")
    cut = set(wl.cut_at("train", 16))
    assert len(cut) >= 2  # the long rows that hash into train
    batch_rows = {tuple(wl.make_batch("train", i, 1, 16)["input_ids"][0].tolist()) for i in range(60)}
    long_rows = {tuple(wl._encode(wl._rows("train")[k])[0][:16]) for k in cut}
    assert not batch_rows & long_rows  # a cut row fills all 16 positions: none of them is ever in a batch
    warn = HFWorkload(str(llama), data=str(data))
    assert {tuple(warn.make_batch("train", i, 1, 16)["input_ids"][0].tolist()) for i in range(60)} & long_rows


def test_validation_comes_from_val_data_or_a_split_folder(tmp_path, llama):
    from probes.hf import HFWorkload

    write_tokenizer(llama)
    rows = [dict(qa(3, 3, i), patient=i % 8) for i in range(40)]
    write_rows(tmp_path / "all.jsonl", rows)
    r = CliRunner().invoke(cli, ["split", str(tmp_path / "all.jsonl"), "--by", "patient", "--ratios", "0.75,0.25",
                                 "--out", str(tmp_path / "s")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    wl = HFWorkload(str(llama), data=str(tmp_path / "s"))
    train_p = {r["patient"] for r in wl._rows("train")}
    val_p = {r["patient"] for r in wl._rows("val")}
    assert train_p and val_p and not train_p & val_p  # the split's groups, not a hash of the row number
    val_ids = {tuple(wl.make_batch("val", i, 1, 8)["input_ids"][0].tolist()) for i in range(10)}
    expect = {tuple((wl._encode(r)[0] + [wl.tokenizer.pad_token_id] * 8)[:8]) for r in wl._rows("val")}
    assert val_ids <= expect
    same = HFWorkload(str(llama), data=str(tmp_path / "s" / "train.jsonl"), val_data=str(tmp_path / "s" / "val.jsonl"))
    assert same._rows("val") == wl._rows("val")
    assert "validation rows from" in wl.data_report({"train": 64})[0]
    assert "every 10th row" in HFWorkload(str(llama), data=str(tmp_path / "all.jsonl")).data_report({"train": 64})[0]
