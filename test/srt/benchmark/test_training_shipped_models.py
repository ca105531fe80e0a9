"""The trained MoE checkpoints shipped in benchmark/oea/models/: each loads from its own files and
reproduces the held-out loss its training run recorded (benchmark/oea/training/train_moe.py wrote both)."""

import json
import math
import os

import pytest

from training import train_moe as tm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODELS = os.path.join(ROOT, "benchmark", "oea", "models")
SHIPPED = ("qwen3_moe_stdlib", "glm4_moe_stdlib")
MAX_BYTES = 30 * 1024 * 1024


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_reproduces_its_recorded_heldout_loss(name):
    model_dir = os.path.join(MODELS, name)
    with open(os.path.join(model_dir, "training.json")) as f:
        record = json.load(f)
    assert os.path.getsize(os.path.join(model_dir, "model.safetensors")) <= MAX_BYTES
    recorded = record["heldout"]
    got = tm.heldout_loss(model_dir, recorded["max_tokens"], recorded["seq_len"])
    assert got["tokens"] == recorded["tokens"]
    # The thread count of the machine can move the 4th-5th significant digit of a float32 sum.
    assert got["loss"] == pytest.approx(recorded["loss"], rel=1e-4)
    # Trained, not random: a uniform guess over the vocabulary scores ln(V) nats per token.
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert got["loss"] < 0.6 * math.log(vocab)
