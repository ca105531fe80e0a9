r"""Train a small MoE language model of one of the router families we serve, on real text, seeded.

    python benchmark/oea/training/train_moe.py --arch qwen3_moe --out benchmark/oea/models/qwen3_moe_stdlib
    python benchmark/oea/training/train_moe.py --arch glm4_moe --out benchmark/oea/models/glm4_moe_stdlib
    python benchmark/oea/training/train_moe.py --arch deepseek_v3 --out benchmark/oea/models/deepseek_v3_stdlib
    python benchmark/oea/training/train_moe.py --arch qwen3_moe --out /tmp/m --steps 3 --max-docs 20 \
        --num-experts 16 --hidden-size 32 ...     # a smoke run (test/srt/benchmark/test_training_train_moe.py)

qwen3_moe: Qwen3MoeForCausalLM, softmax routing, renormalised top-k, trained with transformers'
           load-balancing auxiliary loss (router_aux_loss_coef, Qwen3-30B's 0.001).
glm4_moe:  Glm4MoeForCausalLM, sigmoid scores, e_score_correction_bias, expert groups, one shared
           expert, routed_scaling_factor. No auxiliary loss: the correction bias is learned the
           DeepSeek-V3 way (aux-loss-free balancing). After each optimizer step, each layer's bias
           moves by --bias-update-speed toward balance, by the sign of its expert's load error:
               b_e += speed * sign(mean_e' load_e' - load_e)
           where load_e counts the tokens the layer's router selected expert e for in that step.
           The bias is a buffer, so the optimizer never touches it; it changes selection only,
           never the weights (selection scores sigmoid + b, weight scores sigmoid).
deepseek_v3: DeepseekV3ForCausalLM (GLM-5's family): MLA attention, a dense first layer, then the
           glm4_moe router (one group by default) balanced the same way, plus one multi-token-
           prediction layer trained as DeepSeek-V3 trains it (loss = main + --mtp-loss-weight * MTP
           t+2 loss) on the input SGLang's NextN draft gets; see deepseek_mtp.py. The MTP layer is
           saved as model.layers.{num_layers}.* (SGLang's nextn names; transformers skips it).

Corpus: the Python standard library's own *.py source that ships with this interpreter
(sysconfig stdlib path), sorted by relative path, skipping site-packages and every test folder
(`test`, `tests`, `idle_test`): real text nobody here wrote, offline on every machine. Documents
(files) are split by a seeded hash of their relative path (see is_heldout); the held-out documents
are never trained on, not even by the tokenizer, and are written to OUT/heldout.txt.

The model config comes from sglang_oea.tiny_model (the same fields the project already serves),
the byte-level BPE tokenizer too, trained here on the training split. Writes into --out:
config.json, generation_config.json, model.safetensors (--save-dtype, the correction bias stays
float32), the tokenizer files, heldout.txt and training.json (command, corpus, split, token
counts, wall time, loss curve, final train loss, held-out loss, seed, versions).
heldout_loss(directory) recomputes the recorded held-out loss from the saved files alone, and
heldout_mtp_loss(directory) the deepseek_v3 MTP layer's (t+2) held-out loss and accuracy.

Shapes: B = sequences per step, S = --seq-len, V = vocab, L = MoE layers, E = experts, K = top-k.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shlex
import sys
import sysconfig
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

from sglang_oea.cpu.tiny_model import write_model  # noqa: E402
from training import deepseek_mtp  # noqa: E402

MAX_CHECKPOINT_BYTES = 30 * 1000 * 1000
SKIPPED_FOLDERS = ("site-packages", "test", "tests", "idle_test", "__pycache__")
DOCUMENT_HEADER = "<|document|> "  # heldout.txt: a line "<|document|> relpath", then the file's text
EOS = "<|endoftext|>"
Document = Tuple[str, str]  # (path relative to the stdlib folder, text)


def stdlib_root() -> str:
    """The folder of this interpreter's standard library source."""
    return sysconfig.get_paths()["stdlib"]


def list_documents(root: str) -> List[Document]:
    """Every *.py file below `root`, sorted by relative path, minus SKIPPED_FOLDERS; one document each."""
    names = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [s for s in subfolders if s not in SKIPPED_FOLDERS]
        names += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    documents = []
    for name in sorted(n.replace(os.sep, "/") for n in names):
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            documents.append((name, f.read()))
    return documents


def is_heldout(name: str, split_seed: int, heldout_fraction: float) -> bool:
    """True when the document `name` is held out: sha256("{split_seed}:{name}")'s first 8 bytes,
    read as a big-endian fraction of 2**64, fall below `heldout_fraction`."""
    digest = hashlib.sha256(f"{split_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def split_documents(documents: Sequence[Document], split_seed: int,
                    heldout_fraction: float) -> Tuple[List[Document], List[Document]]:
    """(train, held-out) by is_heldout, each in the input's order."""
    train = [d for d in documents if not is_heldout(d[0], split_seed, heldout_fraction)]
    heldout = [d for d in documents if is_heldout(d[0], split_seed, heldout_fraction)]
    return train, heldout


def write_heldout(path: str, documents: Sequence[Document]) -> None:
    """Write `documents` as heldout.txt: per document a DOCUMENT_HEADER line, then its text."""
    with open(path, "w", encoding="utf-8") as f:
        for name, text in documents:
            if any(line.startswith(DOCUMENT_HEADER) for line in text.splitlines()):
                raise ValueError(f"{name} contains the held-out separator {DOCUMENT_HEADER!r}")
            f.write(f"{DOCUMENT_HEADER}{name}\n{text}")
            if not text.endswith("\n"):
                f.write("\n")


def read_heldout(path: str) -> List[Document]:
    """The documents of a heldout.txt written by write_heldout (each text ends with one newline)."""
    with open(path, encoding="utf-8") as f:
        parts = re.split(rf"^{re.escape(DOCUMENT_HEADER)}(.*)\n", f.read(), flags=re.MULTILINE)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts), 2)]


def normalise_text(text: str) -> str:
    """A document's text as heldout.txt stores it (and as every stream encodes it): ending in a newline."""
    return text if text.endswith("\n") else text + "\n"


def encode_stream(tokenizer, texts: Iterable[str]) -> torch.Tensor:
    """Token ids of the texts joined by EOS, EOS first: [N] int64."""
    eos_id = tokenizer.token_to_id(EOS)
    ids = [eos_id]
    for encoding in tokenizer.encode_batch([normalise_text(t) for t in texts]):
        ids += encoding.ids + [eos_id]
    return torch.tensor(ids, dtype=torch.long)


def pack_blocks(stream: torch.Tensor, seq_len: int, max_tokens: Optional[int] = None) -> torch.Tensor:
    """Cut `stream` [N] into non-overlapping rows of seq_len, dropping the tail: [N // S, S]."""
    usable = stream.numel() if max_tokens is None else min(stream.numel(), max_tokens)
    rows = usable // seq_len
    return stream[: rows * seq_len].view(rows, seq_len)


def token_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token negative log-likelihoods of ids [B, S] under `model`: [B, S - 1] float32."""
    logits = model(input_ids=ids, use_cache=False).logits.float()  # [B, S, V]
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")


def routers_of(model, mtp=None) -> List[torch.nn.Module]:
    """Each MoE layer's router (`mlp.gate`, which returns (logits, weights, ids [T, K]) in every family),
    the MTP layer's last."""
    layers = list(model.model.layers) + ([mtp.decoder] if mtp is not None else [])
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]


def uses_correction_bias(arch: str) -> bool:
    """The sigmoid routers with e_score_correction_bias, balanced aux-loss-free."""
    return arch in ("glm4_moe", "deepseek_v3")


class ExpertLoad:
    """Counts, per MoE layer, the tokens its router selects each expert for: counts [L, E] float32.

    A forward hook on each router reads the selected ids (output 2); reset() between steps."""

    def __init__(self, routers: Sequence[torch.nn.Module], num_experts: int):
        self.counts = torch.zeros(len(routers), num_experts)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def count(module, inputs, output):
            ids = output[2].reshape(-1)  # [T * K]
            self.counts[layer] += torch.bincount(ids, minlength=self.counts.shape[1]).float()
        return count

    def reset(self) -> None:
        self.counts.zero_()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def update_correction_bias(routers: Sequence[torch.nn.Module], counts: torch.Tensor, speed: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): b_e += speed * sign(mean load - load_e), per layer."""
    for router, load in zip(routers, counts):  # load [E]
        router.e_score_correction_bias += speed * torch.sign(load.mean() - load)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over --warmup-steps, then cosine decay to --min-lr-ratio * --lr at --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(args: argparse.Namespace, train_texts: Sequence[str]):
    """Tokenizer and config.json into args.out (sglang_oea.tiny_model; deepseek_mtp for deepseek_v3),
    then a seeded float32 model and its MTP layer (deepseek_v3; else None)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.arch == "deepseek_v3":
        deepseek_mtp.write_deepseek_v3_model(args, train_texts)
    else:
        write_model(args, texts=train_texts)
    config = AutoConfig.from_pretrained(args.out)
    if args.arch == "qwen3_moe":
        config.router_aux_loss_coef = args.aux_loss_coef
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, (deepseek_mtp.build_mtp(model, args.seed) if args.arch == "deepseek_v3" else None)


def checkpoint_bytes(model, dtype: torch.dtype, mtp=None) -> int:
    """Bytes model.safetensors will hold (float tensors in `dtype`, the correction bias float32)."""
    total = 0
    extra = deepseek_mtp.mtp_checkpoint_tensors(model, mtp) if mtp is not None else {}
    for name, tensor in list(model.state_dict().items()) + list(extra.items()):
        keep_fp32 = name.endswith("e_score_correction_bias")
        total += tensor.numel() * (4 if keep_fp32 else torch.tensor([], dtype=dtype).element_size())
    return total


def train(args: argparse.Namespace, model, blocks: torch.Tensor, mtp=None) -> Dict:
    """AdamW over seeded permutations of blocks [R, S] (the model's and the MTP layer's parameters);
    returns the run's record (loss curve etc.)."""
    routers = routers_of(model, mtp)
    load = ExpertLoad(routers, args.num_experts)
    parameters = list(model.parameters()) + (list(mtp.parameters()) if mtp is not None else [])
    decay = [p for p in parameters if p.dim() >= 2]
    no_decay = [p for p in parameters if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    order = torch.Generator().manual_seed(args.seed)
    permutation, cursor = torch.randperm(blocks.shape[0], generator=order), 0
    curve, window, aux_window = [], [], []
    start, stopped_by = time.monotonic(), "steps"
    model.train()
    coef = args.mtp_loss_weight if mtp is not None else getattr(model.config, "router_aux_loss_coef", 0.0)
    for step in range(args.steps):
        if cursor + args.batch_size > permutation.numel():
            permutation, cursor = torch.randperm(blocks.shape[0], generator=order), 0
        ids = blocks[permutation[cursor: cursor + args.batch_size]]  # [B, S]
        cursor += args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        load.reset()
        lm_loss, aux_loss = step_loss(args, model, ids, mtp)
        loss = lm_loss + (coef * aux_loss if aux_loss is not None else 0.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, args.grad_clip)
        optimizer.step()
        if uses_correction_bias(args.arch):
            update_correction_bias(routers, load.counts, args.bias_update_speed)
        window.append(lm_loss.item())
        aux_window.append(aux_loss.item() if aux_loss is not None else None)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            curve.append(curve_point(step, window, aux_window, load.counts, start, args))
            print(json.dumps(curve[-1]), flush=True)
            window, aux_window = [], []
        if args.minutes and time.monotonic() - start > args.minutes * 60:
            stopped_by = "minutes"
            if window:
                curve.append(curve_point(step, window, aux_window, load.counts, start, args))
            break
    load.remove()
    wall = time.monotonic() - start
    steps_done = step + 1
    return {"steps_done": steps_done, "stopped_by": stopped_by, "wall_seconds": round(wall, 2),
            "tokens_trained": steps_done * args.batch_size * args.seq_len,
            "tokens_per_second": round(steps_done * args.batch_size * args.seq_len / wall, 1),
            "loss_curve": curve, "final_train_loss": curve[-1]["loss"]}


def step_loss(args: argparse.Namespace, model, ids: torch.Tensor,
              mtp=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(mean next-token NLL, the second objective or None) of one batch ids [B, S]: transformers'
    load-balancing aux loss (qwen3_moe), the MTP layer's mean t+2 NLL (deepseek_v3), else None."""
    if mtp is not None:
        logits, draft = deepseek_mtp.main_and_mtp_logits(model, mtp, ids)  # [B, S, V], [B, S - 1, V]
        mtp_loss = F.cross_entropy(draft[:, :-1].reshape(-1, draft.shape[-1]), ids[:, 2:].reshape(-1))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)), mtp_loss
    if args.arch == "qwen3_moe" and args.aux_loss_coef > 0:
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
        logits, aux = out.logits.float(), out.aux_loss
    else:
        logits, aux = model(input_ids=ids, use_cache=False).logits.float(), None
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)), aux


def curve_point(step: int, window: List[float], aux_window: List, counts: torch.Tensor,
                start: float, args: argparse.Namespace) -> Dict:
    """One loss-curve entry: mean LM loss (and aux loss) over the steps since the last entry."""
    point = {"step": step + 1, "loss": round(sum(window) / len(window), 5), "lr": round(learning_rate(step, args), 7),
             "seconds": round(time.monotonic() - start, 1),
             "max_over_mean_load": round((counts.max(dim=1).values / counts.mean(dim=1)).max().item(), 3)}
    if aux_window and aux_window[0] is not None:
        point["mtp_loss" if args.arch == "deepseek_v3" else "aux_loss"] = round(sum(aux_window) / len(aux_window), 5)
    return point


def save_checkpoint(model, out: str, dtype: torch.dtype) -> int:
    """save_pretrained (safetensors) in `dtype`, the correction bias kept float32; returns the file's bytes."""
    biases = {name: buf.detach().clone() for name, buf in model.named_buffers()
              if name.endswith("e_score_correction_bias")}
    model.to(dtype)
    for name, bias in biases.items():
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, bias)
    model.save_pretrained(out)
    return os.path.getsize(os.path.join(out, "model.safetensors"))


def heldout_loss(model_dir: str, max_tokens: int = 65536, seq_len: int = 256, batch_size: int = 8) -> Dict:
    """Mean next-token NLL per token (nats) of the saved model on its heldout.txt.

    The held-out documents are encoded as in training (joined by EOS, see encode_stream), cut
    into rows of `seq_len` within the first `max_tokens` tokens, and scored in float32.

    Returns:
        {"loss": float, "perplexity": float, "tokens": scored predictions, "max_tokens", "seq_len"}.
    """
    blocks = heldout_blocks(model_dir, max_tokens, seq_len)
    model = load_trained(model_dir)
    total = 0.0
    with torch.no_grad():
        for rows in blocks.split(batch_size):
            total += token_nll(model, rows).double().sum().item()
    tokens = blocks.shape[0] * (seq_len - 1)
    return {"loss": total / tokens, "perplexity": math.exp(total / tokens), "tokens": tokens,
            "max_tokens": max_tokens, "seq_len": seq_len}


def load_trained(model_dir: str):
    """The saved model in float32, eval mode, through transformers' AutoModelForCausalLM.

    transformers' load report is kept quiet (a deepseek_v3 checkpoint's MTP layer is unexpected to
    it by design) and checked here instead: ValueError on any missing or mismatched tensor, or on
    an unexpected one outside the MTP layer (model.layers.{num_hidden_layers}.*).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
    mtp_prefix = f"model.layers.{model.config.num_hidden_layers}."
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith(mtp_prefix)]
    if info["missing_keys"] or info["mismatched_keys"] or unexpected:
        raise ValueError(f"{model_dir}: missing {sorted(info['missing_keys'])}, mismatched "
                         f"{info['mismatched_keys']}, unexpected {sorted(unexpected)}")
    return model.eval()


def heldout_blocks(model_dir: str, max_tokens: int, seq_len: int) -> torch.Tensor:
    """The held-out documents of model_dir, encoded as in training, in rows of seq_len: [R, S] int64."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    documents = read_heldout(os.path.join(model_dir, "heldout.txt"))
    blocks = pack_blocks(encode_stream(tokenizer, [text for _, text in documents]), seq_len, max_tokens)
    if blocks.shape[0] == 0:
        raise ValueError(f"heldout.txt in {model_dir} has fewer than seq_len={seq_len} tokens")
    return blocks


def heldout_mtp_loss(model_dir: str, max_tokens: int = 65536, seq_len: int = 256, batch_size: int = 8) -> Dict:
    """The deepseek_v3 MTP layer on the held-out rows of heldout_loss, from the saved files alone.

    Returns:
        {"loss": mean t+2 NLL (nats), "accuracy": its argmax hit rate, "agreement_with_main": how
        often its argmax equals the main model's argmax one position later (greedy acceptance),
        "main_accuracy": the main model's t+1 argmax hit rate, "tokens", "max_tokens", "seq_len"}.
    """
    blocks = heldout_blocks(model_dir, max_tokens, seq_len)
    model = load_trained(model_dir)
    mtp = deepseek_mtp.load_mtp(model_dir, model)
    sums = {"mtp": 0.0, "mtp_hit": 0.0, "mtp_agrees": 0.0, "main_hit": 0.0}
    with torch.no_grad():
        for rows in blocks.split(batch_size):
            scores = deepseek_mtp.main_and_mtp_nll(model, mtp, rows)
            for key in sums:
                sums[key] += scores[key].double().sum().item()
    tokens = blocks.shape[0] * (seq_len - 2)
    return {"loss": sums["mtp"] / tokens, "accuracy": sums["mtp_hit"] / tokens,
            "agreement_with_main": sums["mtp_agrees"] / tokens,
            "main_accuracy": sums["main_hit"] / (blocks.shape[0] * (seq_len - 1)), "tokens": tokens,
            "max_tokens": max_tokens, "seq_len": seq_len}


def corpus_record(root: str, train_docs: Sequence[Document], heldout_docs: Sequence[Document],
                  args: argparse.Namespace) -> Dict:
    """training.json's corpus entry (the token counts are added once the tokenizer exists)."""
    digest = hashlib.sha256()
    for name, text in list(train_docs) + list(heldout_docs):
        digest.update(name.encode() + b"\0" + text.encode("utf-8", "surrogateescape") + b"\0")
    return {"source": "Python standard library source (*.py)", "path": root,
            "python_version": platform.python_version(),
            "file_rule": f"*.py below path, sorted by relative path, skipping folders named {list(SKIPPED_FOLDERS)}",
            "split_rule": (f"held out when int.from_bytes(sha256(f'{{split_seed}}:{{relpath}}').digest()[:8], 'big') "
                           f"/ 2**64 < {args.heldout_fraction}, split_seed={args.split_seed}"),
            "max_docs": args.max_docs, "train_files": len(train_docs), "heldout_files": len(heldout_docs),
            "heldout_names": [name for name, _ in heldout_docs], "sha256": digest.hexdigest()}


def check_arguments(args: argparse.Namespace) -> None:
    """Configuration errors, raised as ValueError naming the flag."""
    if args.top_k > args.num_experts:
        raise ValueError(f"--top-k must be <= --num-experts ({args.num_experts}), got {args.top_k}")
    if uses_correction_bias(args.arch) and args.num_experts % args.num_groups:
        raise ValueError(f"--num-experts ({args.num_experts}) must be divisible by --num-groups ({args.num_groups})")
    if uses_correction_bias(args.arch) and args.topk_group * (args.num_experts // args.num_groups) < args.top_k:
        raise ValueError(f"--topk-group {args.topk_group} groups hold fewer than --top-k {args.top_k} experts")
    if not 0 < args.heldout_fraction < 1:
        raise ValueError(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    if args.warmup_steps < 1 or args.steps < 1:
        raise ValueError(f"--steps and --warmup-steps must be >= 1, got {args.steps} and {args.warmup_steps}")
    if args.arch == "deepseek_v3" and (args.hidden_size % (2 * args.num_heads) or args.seq_len < 3
                                       or args.num_layers < 2):
        # One layer would be the dense one, and SGLang reads a 1-layer model's MTP layer at index 0.
        raise ValueError(f"deepseek_v3 needs --hidden-size divisible by 2 * --num-heads ({2 * args.num_heads}), "
                         f"--seq-len >= 3 and --num-layers >= 2, got {args.hidden_size}, {args.seq_len}, "
                         f"{args.num_layers}")


ARCH_DEFAULTS = {  # about 7.7M parameters (15.5 MB in bfloat16), under 50 minutes on 2 busy cores
    "qwen3_moe": {"num_experts": 128, "moe_intermediate_size": 32, "steps": 3000},  # ~5k tokens/s
    "glm4_moe": {"num_experts": 256, "moe_intermediate_size": 16, "steps": 2400,  # ~3.7k tokens/s
                 "num_groups": 8, "topk_group": 4},
    "deepseek_v3": {"num_experts": 256, "moe_intermediate_size": 16, "steps": 1500,  # 6.2M + 1.7M MTP, 18.0 MB
                    "num_groups": 1, "topk_group": 1},
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=sorted(ARCH_DEFAULTS), required=True)
    p.add_argument("--out", required=True, help="directory to write")
    model = p.add_argument_group("model (names as in sglang_oea.tiny_model)")
    model.add_argument("--num-experts", type=int, help="default: 128 (qwen3_moe), 256 (glm4_moe, deepseek_v3)")
    model.add_argument("--top-k", type=int, default=8)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--moe-intermediate-size", type=int, help="default: 32 (qwen3_moe), 16 (the others)")
    model.add_argument("--num-layers", type=int, default=4, help="deepseek_v3: the first one dense, MTP not counted")
    model.add_argument("--num-heads", type=int, default=4)
    model.add_argument("--num-groups", type=int, help="glm4_moe, deepseek_v3: expert groups (n_group); default 8, 1")
    model.add_argument("--topk-group", type=int, help="groups each token may use (topk_group); default 4, 1")
    model.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size to train")
    data = p.add_argument_group("data")
    data.add_argument("--corpus-root", default=None, help="default: this interpreter's stdlib folder")
    data.add_argument("--split-seed", type=int, default=0)
    data.add_argument("--heldout-fraction", type=float, default=0.05)
    data.add_argument("--max-docs", type=int, default=None, help="use the first N documents of each split (smoke runs)")
    data.add_argument("--seq-len", type=int, default=256)
    data.add_argument("--heldout-tokens", type=int, default=65536, help="held-out token budget scored")
    run = p.add_argument_group("training")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--steps", type=int, help="optimizer steps, the schedule's length; default: 3000 (qwen3_moe), "
                     "2400 (glm4_moe), 4096 tokens each")
    run.add_argument("--minutes", type=float, default=None,
                     help="also stop after this many minutes (recorded as stopped_by; such a run is not reproducible)")
    run.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    run.add_argument("--lr", type=float, default=3e-3)
    run.add_argument("--min-lr-ratio", type=float, default=0.1)
    run.add_argument("--warmup-steps", type=int, default=100)
    run.add_argument("--weight-decay", type=float, default=0.1)
    run.add_argument("--grad-clip", type=float, default=1.0)
    run.add_argument("--aux-loss-coef", type=float, default=0.001, help="qwen3_moe: router_aux_loss_coef")
    run.add_argument("--bias-update-speed", type=float, default=1e-3,
                     help="glm4_moe, deepseek_v3: correction-bias step")
    run.add_argument("--mtp-loss-weight", type=float, default=0.3,
                     help="deepseek_v3: lambda in main loss + lambda * MTP loss")
    run.add_argument("--log-every", type=int, default=50)
    run.add_argument("--threads", type=int, default=2,
                     help="torch threads; results are reproducible for one thread count (use 1 on a busy machine)")
    run.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    run.add_argument("--allow-large", action="store_true", help=f"write checkpoints over {MAX_CHECKPOINT_BYTES} bytes")
    args = p.parse_args(argv)
    for name, value in {"num_groups": 1, "topk_group": 1, **ARCH_DEFAULTS[args.arch]}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup_steps > args.steps:
        args.warmup_steps = args.steps
    check_arguments(args)
    return args


def main(argv: Optional[List[str]] = None) -> Dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    root = args.corpus_root or stdlib_root()
    train_docs, heldout_docs = split_documents(list_documents(root), args.split_seed, args.heldout_fraction)
    train_docs, heldout_docs = train_docs[: args.max_docs], heldout_docs[: args.max_docs]
    os.makedirs(args.out, exist_ok=True)
    write_heldout(os.path.join(args.out, "heldout.txt"), heldout_docs)
    model, mtp = build_model(args, [text for _, text in train_docs])
    dtype = getattr(torch, args.save_dtype)
    size = checkpoint_bytes(model, dtype, mtp)
    parameters = {"parameters": sum(p.numel() for p in model.parameters())}
    if mtp is not None:
        parameters["mtp_parameters"] = sum(p.numel() for p in mtp.parameters())
    print(f"model: {parameters} parameters, checkpoint {size / 1e6:.1f} MB", flush=True)
    if size > MAX_CHECKPOINT_BYTES and not args.allow_large:
        raise ValueError(f"checkpoint would be {size} bytes, over {MAX_CHECKPOINT_BYTES}: shrink the model "
                         "or pass --allow-large")

    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(args.out, "tokenizer.json"))
    train_stream = encode_stream(tokenizer, [text for _, text in train_docs])
    heldout_stream = encode_stream(tokenizer, [text for _, text in heldout_docs])
    blocks = pack_blocks(train_stream, args.seq_len)
    if blocks.shape[0] < args.batch_size:
        raise ValueError(f"{blocks.shape[0]} training rows of --seq-len {args.seq_len} "
                         f"< --batch-size {args.batch_size}")
    record = {"command": shlex.join([sys.executable, *sys.argv] if argv is None else ["train_moe.py", *argv]),
              "arguments": vars(args), "seed": args.seed,
              "corpus": {**corpus_record(root, train_docs, heldout_docs, args),
                         "train_tokens": train_stream.numel(), "heldout_tokens": heldout_stream.numel()},
              "model": {"arch": args.arch, **parameters},
              "objective": objective_record(args),
              "versions": versions()}
    record["training"] = train(args, model, blocks, mtp)
    record["model"]["checkpoint_bytes"] = save_checkpoint(model, args.out, dtype)
    if mtp is not None:
        record["model"]["checkpoint_bytes"] = deepseek_mtp.append_mtp_weights(
            os.path.join(args.out, "model.safetensors"), model, mtp, dtype)
    record["model"]["save_dtype"] = args.save_dtype
    record["heldout"] = heldout_loss(args.out, args.heldout_tokens, args.seq_len)
    if mtp is not None:
        record["heldout_mtp"] = heldout_mtp_loss(args.out, args.heldout_tokens, args.seq_len)
    if uses_correction_bias(args.arch):
        biases = torch.stack([r.e_score_correction_bias.float() for r in routers_of(model, mtp)])  # [L, E]
        record["correction_bias"] = {"abs_max": biases.abs().max().item(), "std": biases.std().item()}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(f"{args.out}: train loss {record['training']['final_train_loss']:.4f}, held-out loss "
          f"{record['heldout']['loss']:.4f} (ppl {record['heldout']['perplexity']:.1f}), "
          f"{record['training']['tokens_per_second']:.0f} tokens/s, checkpoint "
          f"{record['model']['checkpoint_bytes'] / 1e6:.1f} MB", flush=True)
    return record


def objective_record(args: argparse.Namespace) -> Dict:
    """What the loss and the balancing were, in words and numbers."""
    common = {"loss": "mean next-token cross-entropy over packed rows of seq_len (documents joined by EOS)",
              "optimizer": "AdamW(betas=(0.9, 0.95)), weight decay on matrices only",
              "schedule": f"linear warm-up {args.warmup_steps} steps, cosine to {args.min_lr_ratio} x lr"}
    if args.arch == "qwen3_moe":
        return {**common, "balancing": "transformers' load_balancing_loss_func (output_router_logits=True)",
                "router_aux_loss_coef": args.aux_loss_coef}
    balancing = {"balancing": "aux-loss-free: e_score_correction_bias += speed * sign(mean load - load) "
                 "per layer after each optimizer step; no auxiliary loss", "bias_update_speed": args.bias_update_speed}
    if args.arch == "glm4_moe":
        return {**common, **balancing}
    return {**common, **balancing, "loss": common["loss"] + f" + {args.mtp_loss_weight} x MTP t+2 cross-entropy",
            "mtp_loss_weight": args.mtp_loss_weight, "mtp": deepseek_mtp.MTP_RECORD}


def versions() -> Dict:
    import tokenizers
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine()}


if __name__ == "__main__":
    main()
