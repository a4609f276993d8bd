"""Record factories: tests state only the fields they are about (no torch needed)."""

from __future__ import annotations

import json

from planner.ledger import Ledger
from planner.records import PHASES, Line, ProbeConfig

MiB = 2**20
GiB = 2**30
PARAMS = {"layers": 2, "d_model": 64}


def config(**kw) -> ProbeConfig:
    kw.setdefault("workload", "builtin:gpt")
    kw.setdefault("params_json", json.dumps(PARAMS, sort_keys=True))
    kw.setdefault("precision", "bf16")
    return ProbeConfig(**kw)


def line(cfg: ProbeConfig | None = None, phase: str = "steady", **kw) -> Line:
    cfg = cfg or config()
    base = dict(run_id=f"r-{cfg.key()}", probe_id="p-test", phase=phase, verdict="ok", device="cpu",
                device_name="Test CPU", device_total_bytes=64 * GiB, torch_version="2.13.0+cpu", cuda_version=None,
                host="test", started_at="2026-12-01T10:00:00+00:00", seconds=0.1,
                baseline_allocated_bytes=100 * MiB, peak_allocated_bytes=200 * MiB)
    base.update(kw)
    return Line.from_config(cfg, **base)


def pilot_lines(cfg: ProbeConfig, peak_bytes: dict[str, int] | int, update_s: float = 0.05,
                flops_per_update: float = 1e12, reserved: bool = False, device: str = "cpu",
                device_name: str = "Test CPU", params: int = 1_000_000, trainable: int | None = None,
                optimizer_state_bytes: int | None = None, **extra) -> list[Line]:
    """All seven phases of one configuration, ok, with the given peaks. Each fact sits on the phase the pilot
    writes it on (tests/test_recommendations.py checks this against a real pilot): parameter counts on setup,
    optimizer state on first_step, the update's time and census on steady, the export's time on export."""
    out = []
    for phase in PHASES:
        peak = peak_bytes if isinstance(peak_bytes, int) else peak_bytes.get(phase, 100 * MiB)
        kw = dict(peak_allocated_bytes=peak, device=device, device_name=device_name,
                  peak_reserved_bytes=int(peak * 1.1) if reserved else None, **extra)
        if phase == "setup":
            kw.update(param_count=params, trainable_param_count=params if trainable is None else trainable,
                      param_bytes=4 * params)
        if phase == "first_step":
            kw.update(optimizer_state_bytes=8 * params if optimizer_state_bytes is None else optimizer_state_bytes)
        if phase == "save":  # the checkpoint file: weights, optimizer state and a little more
            kw.update(checkpoint_bytes=4 * params + (8 * params if optimizer_state_bytes is None
                                                     else optimizer_state_bytes) + 4096)
        if phase == "export":  # the safetensors weights
            kw.update(checkpoint_bytes=4 * params + 1024)
        if phase == "steady":
            kw.update(update_s=update_s, update_times_s=json.dumps([update_s] * 3), ops_per_update=500,
                      flops_per_update=flops_per_update)
        out.append(line(cfg, phase, **kw))
    return out


def write_ledger(path, lines) -> str:
    with Ledger(path) as led:
        led.extend(lines)
    return str(path)


def campaign_yaml(**kw) -> str:
    import yaml

    doc = {
        "name": "test-campaign", "workload": "builtin:gpt", "params": PARAMS, "precision": "bf16",
        "seq_len": 256, "effective_batch": 16, "updates": 200,
        "eval": {"every_updates": 50, "examples": 64, "seq_len": 256}, "setup_hours": 1,
        "variants": [{"id": "control", "lr": 1e-4, "priority": 1}, {"id": "lr-half", "lr": 5e-5, "priority": 2}],
    }
    doc.update(kw)  # a key given as None is left out: the spec's default applies
    return yaml.safe_dump({k: v for k, v in doc.items() if v is not None}, sort_keys=False)


def standard_ledger(path, scale: int = 1) -> str:
    """Four configurations whose memory follows a + b·tokens exactly: enough for the fitted model."""
    lines = []
    for mb, seq in [(1, 128), (2, 128), (1, 256), (4, 256)]:
        peak = scale * (100 * MiB + mb * seq * 50_000)
        lines += pilot_lines(config(micro_batch=mb, seq_len=seq, eval_seq_len=seq, eval_micro_batch=mb), peak)
    return write_ledger(path, lines)


def tiny_llama(path, width: int = 64, vocab: int = 256):
    """A Llama config.json of two layers (4 heads, 2 KV heads) for hf: workloads; nothing downloaded."""
    import transformers

    transformers.LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                             max_position_embeddings=512, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path
