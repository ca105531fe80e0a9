"""benchmark/oea/training/train_moe.py: a smoke run of a few steps per router family, tiny sizes, no
server (deepseek_v3's MTP layer and its SGLang names: test_training_deepseek_mtp.py).

Each run is a subprocess (the tool sets torch's thread count and deterministic mode process-wide).
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from training import train_moe as tm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOOL = os.path.join(ROOT, "benchmark", "oea", "training", "train_moe.py")
STEPS, BIAS_SPEED = 6, 1e-3
SMOKE = ["--steps", str(STEPS), "--warmup-steps", "2", "--log-every", "2", "--max-docs", "12",
         "--num-experts", "16", "--num-groups", "4", "--topk-group", "2", "--top-k", "4",
         "--hidden-size", "32", "--moe-intermediate-size", "16", "--num-layers", "2", "--num-heads", "4",
         "--vocab-size", "384", "--seq-len", "64", "--batch-size", "4", "--heldout-tokens", "2048",
         "--bias-update-speed", str(BIAS_SPEED), "--threads", "1"]
RECORDED = ["command", "arguments", "seed", "corpus", "model", "objective", "versions", "training", "heldout"]


def run_tool(arch: str, out: str) -> dict:
    path = os.pathsep.join([os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run([sys.executable, TOOL, "--arch", arch, "--out", out, *SMOKE], check=True, env=env,
                   stdout=subprocess.DEVNULL, timeout=120)
    with open(os.path.join(out, "training.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe", "deepseek_v3"])
def runs(request, tmp_path_factory):
    """Two runs of one arch with the same seed: [(directory, training.json), ...]."""
    dirs = [str(tmp_path_factory.mktemp(f"{request.param}_{i}")) for i in range(2)]
    return request.param, [(d, run_tool(request.param, d)) for d in dirs]


def test_writes_a_model_transformers_loads(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, [(directory, record), _] = runs
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "heldout.txt"]:
        assert os.path.isfile(os.path.join(directory, name)), name
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert type(model).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                                    "deepseek_v3": "DeepseekV3ForCausalLM"}[arch]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    text = tm.read_heldout(os.path.join(directory, "heldout.txt"))[0][1][:500]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert record["model"]["checkpoint_bytes"] == os.path.getsize(os.path.join(directory, "model.safetensors"))


def test_records_the_run(runs):
    _, [(_, record), _] = runs
    assert set(RECORDED) <= set(record)
    corpus = record["corpus"]
    for key in ["path", "python_version", "split_rule", "train_files", "heldout_files", "train_tokens",
                "heldout_tokens"]:
        assert key in corpus, key
    assert len(record["training"]["loss_curve"]) == STEPS // 2
    assert math.isfinite(record["training"]["final_train_loss"]) and math.isfinite(record["heldout"]["loss"])
    assert record["versions"]["torch"] == torch.__version__


def test_heldout_documents_are_never_trained_on(runs):
    _, [(directory, record), _] = runs
    documents = tm.list_documents(record["corpus"]["path"])
    train, heldout = tm.split_documents(documents, record["arguments"]["split_seed"],
                                        record["arguments"]["heldout_fraction"])
    written = tm.read_heldout(os.path.join(directory, "heldout.txt"))
    assert [name for name, _ in written] == record["corpus"]["heldout_names"] == [n for n, _ in heldout[:12]]
    assert not {name for name, _ in written} & {name for name, _ in train}
    texts = dict(documents)
    assert all(tm.normalise_text(texts[name]) == text for name, text in written)


def test_same_seed_same_losses(runs):
    _, [(_, first), (_, second)] = runs
    assert first["training"]["loss_curve"][-1]["step"] == STEPS
    assert [p["loss"] for p in first["training"]["loss_curve"]] == [p["loss"] for p in second["training"]["loss_curve"]]
    assert first["heldout"]["loss"] == second["heldout"]["loss"]


def test_heldout_loss_reproduces_the_recorded_one(runs):
    _, [(directory, record), _] = runs
    again = tm.heldout_loss(directory, record["heldout"]["max_tokens"], record["heldout"]["seq_len"])
    assert again["tokens"] == record["heldout"]["tokens"]
    assert again["loss"] == pytest.approx(record["heldout"]["loss"], rel=1e-5)
    if "heldout_mtp" in record:  # deepseek_v3: the MTP layer reloads from the checkpoint's nextn names
        mtp = tm.heldout_mtp_loss(directory, record["heldout"]["max_tokens"], record["heldout"]["seq_len"])
        assert mtp["loss"] == pytest.approx(record["heldout_mtp"]["loss"], rel=1e-5)
        assert mtp["accuracy"] == record["heldout_mtp"]["accuracy"]


def test_mtp_loss_is_recorded(runs):
    arch, [(_, record), _] = runs
    if arch != "deepseek_v3":
        pytest.skip("only deepseek_v3 has an MTP layer")
    assert all(math.isfinite(p["mtp_loss"]) for p in record["training"]["loss_curve"])
    assert record["objective"]["mtp_loss_weight"] == record["arguments"]["mtp_loss_weight"] == 0.3
    assert record["model"]["mtp_parameters"] > 0
    assert {"loss", "accuracy", "agreement_with_main", "tokens"} <= set(record["heldout_mtp"])


def test_correction_bias_moves_by_sign_steps_only(runs):
    """glm4_moe, deepseek_v3 (its MTP layer's router too): the bias moved, in whole steps of the update
    speed (AdamW would leave other values), and it is a buffer, never an optimizer parameter."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    arch, [(directory, _), _] = runs
    if arch == "qwen3_moe":
        pytest.skip("qwen3_moe has no correction bias")
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert not [n for n, _ in model.named_parameters() if "e_score_correction_bias" in n]
    weights = load_file(os.path.join(directory, "model.safetensors"))
    biases = torch.stack([w for n, w in weights.items() if n.endswith("e_score_correction_bias")])  # [L, E]
    assert biases.dtype == torch.float32 and biases.abs().max() > 0
    steps = biases / BIAS_SPEED
    assert (steps - steps.round()).abs().max() < 1e-3
    assert steps.abs().max() <= STEPS
    if arch == "deepseek_v3":
        mtp_layer = model.config.num_hidden_layers
        assert weights[f"model.layers.{mtp_layer}.mlp.gate.e_score_correction_bias"].abs().max() > 0
