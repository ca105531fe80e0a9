"""The trained MoE checkpoints shipped in benchmark/oea/models/: each loads from its own files and
reproduces the held-out loss its training run recorded (benchmark/oea/training/train_moe.py wrote both)."""

import json
import math
import os

import pytest

from training import train_moe as tm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODELS = os.path.join(ROOT, "benchmark", "oea", "models")
SHIPPED = ("qwen3_moe_stdlib", "glm4_moe_stdlib", "deepseek_v3_stdlib")
MAX_BYTES = 30 * 1024 * 1024
# What OEA reads from each checkpoint's config (sglang_oea.model_info): N, top-k, family, groups.
SHAPES = {"qwen3_moe_stdlib": "N=128 top-k=8 routing=softmax",
          "glm4_moe_stdlib": "N=256 top-k=8 routing=sigmoid+bias, groups 4/8",
          "deepseek_v3_stdlib": "N=256 top-k=8 routing=sigmoid+bias"}


def shipped_dir(name: str) -> str:
    return os.path.join(MODELS, name)


@pytest.mark.parametrize("name", SHIPPED)
def test_model_info_reads_each_shipped_checkpoint(name):
    from sglang_oea.model_info import read_moe_shape

    with open(os.path.join(shipped_dir(name), "config.json")) as f:
        assert read_moe_shape(json.load(f)).describe() == SHAPES[name]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_reproduces_its_recorded_heldout_loss(name):
    model_dir = shipped_dir(name)
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


def test_shipped_deepseek_mtp_layer_reproduces_its_recorded_heldout_loss():
    """The MTP layer, rebuilt from the checkpoint's nextn names (model.layers.{L}.*) on top of the
    reloaded main model, reproduces the recorded held-out t+2 loss and accuracy; and it learned:
    below 0.7 ln(V), and its argmax agrees with the main model's next one more often than chance."""
    model_dir = shipped_dir("deepseek_v3_stdlib")
    with open(os.path.join(model_dir, "training.json")) as f:
        recorded = json.load(f)["heldout_mtp"]
    got = tm.heldout_mtp_loss(model_dir, recorded["max_tokens"], recorded["seq_len"])
    assert got["tokens"] == recorded["tokens"]
    assert got["loss"] == pytest.approx(recorded["loss"], rel=1e-4)
    assert got["accuracy"] == pytest.approx(recorded["accuracy"], abs=1e-3)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert got["loss"] < 0.7 * math.log(vocab) and got["agreement_with_main"] > 0.1
