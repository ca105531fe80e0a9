"""Train a small MoE language model of one of the two router families we serve, on real text, seeded.

    python benchmark/oea/training/train_moe.py --arch qwen3_moe --out benchmark/oea/models/qwen3_moe_stdlib
    python benchmark/oea/training/train_moe.py --arch glm4_moe --out benchmark/oea/models/glm4_moe_stdlib
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
heldout_loss(directory) recomputes the recorded held-out loss from the saved files alone.

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

from sglang_oea.tiny_model import SPECIAL_TOKENS, write_model

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


def routers_of(model) -> List[torch.nn.Module]:
    """Each MoE layer's router (`mlp.gate`, which returns (logits, weights, ids [T, K]) in both families)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


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
    """Tokenizer and config.json via sglang_oea.tiny_model into args.out, then a seeded float32 model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    write_model(args, texts=train_texts)
    config = AutoConfig.from_pretrained(args.out)
    if args.arch == "qwen3_moe":
        config.router_aux_loss_coef = args.aux_loss_coef
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def checkpoint_bytes(model, dtype: torch.dtype) -> int:
    """Bytes model.safetensors will hold (float tensors in `dtype`, the correction bias float32)."""
    total = 0
    for name, tensor in model.state_dict().items():
        keep_fp32 = name.endswith("e_score_correction_bias")
        total += tensor.numel() * (4 if keep_fp32 else torch.tensor([], dtype=dtype).element_size())
    return total


def train(args: argparse.Namespace, model, blocks: torch.Tensor) -> Dict:
    """AdamW over seeded permutations of blocks [R, S]; returns the run's record (loss curve etc.)."""
    routers = routers_of(model)
    load = ExpertLoad(routers, args.num_experts)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    order = torch.Generator().manual_seed(args.seed)
    permutation, cursor = torch.randperm(blocks.shape[0], generator=order), 0
    curve, window, aux_window = [], [], []
    start, stopped_by = time.monotonic(), "steps"
    model.train()
    for step in range(args.steps):
        if cursor + args.batch_size > permutation.numel():
            permutation, cursor = torch.randperm(blocks.shape[0], generator=order), 0
        ids = blocks[permutation[cursor: cursor + args.batch_size]]  # [B, S]
        cursor += args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        load.reset()
        lm_loss, aux_loss = step_loss(args, model, ids)
        loss = lm_loss + (model.config.router_aux_loss_coef * aux_loss if aux_loss is not None else 0.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        if args.arch == "glm4_moe":
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


def step_loss(args: argparse.Namespace, model, ids: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(mean next-token NLL, transformers' load-balancing aux loss or None) of one batch ids [B, S]."""
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
        point["aux_loss"] = round(sum(aux_window) / len(aux_window), 5)
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
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    documents = read_heldout(os.path.join(model_dir, "heldout.txt"))
    blocks = pack_blocks(encode_stream(tokenizer, [text for _, text in documents]), seq_len, max_tokens)
    if blocks.shape[0] == 0:
        raise ValueError(f"heldout.txt in {model_dir} has fewer than seq_len={seq_len} tokens")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for rows in blocks.split(batch_size):
            total += token_nll(model, rows).double().sum().item()
    tokens = blocks.shape[0] * (seq_len - 1)
    return {"loss": total / tokens, "perplexity": math.exp(total / tokens), "tokens": tokens,
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
    if args.arch == "glm4_moe" and args.num_experts % args.num_groups:
        raise ValueError(f"--num-experts ({args.num_experts}) must be divisible by --num-groups ({args.num_groups})")
    if args.arch == "glm4_moe" and args.topk_group * (args.num_experts // args.num_groups) < args.top_k:
        raise ValueError(f"--topk-group {args.topk_group} groups hold fewer than --top-k {args.top_k} experts")
    if not 0 < args.heldout_fraction < 1:
        raise ValueError(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    if args.warmup_steps < 1 or args.steps < 1:
        raise ValueError(f"--steps and --warmup-steps must be >= 1, got {args.steps} and {args.warmup_steps}")


ARCH_DEFAULTS = {  # about 7.7M parameters (15.5 MB in bfloat16), under 50 minutes on 2 busy cores
    "qwen3_moe": {"num_experts": 128, "moe_intermediate_size": 32, "steps": 3000},  # ~5k tokens/s
    "glm4_moe": {"num_experts": 256, "moe_intermediate_size": 16, "steps": 2400},  # ~3.7k tokens/s
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=sorted(ARCH_DEFAULTS), required=True)
    p.add_argument("--out", required=True, help="directory to write")
    model = p.add_argument_group("model (names as in sglang_oea.tiny_model)")
    model.add_argument("--num-experts", type=int, help="default: 128 (qwen3_moe), 256 (glm4_moe)")
    model.add_argument("--top-k", type=int, default=8)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--moe-intermediate-size", type=int, help="default: 32 (qwen3_moe), 16 (glm4_moe)")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--num-heads", type=int, default=4)
    model.add_argument("--num-groups", type=int, default=8, help="glm4_moe: expert groups (n_group)")
    model.add_argument("--topk-group", type=int, default=4, help="glm4_moe: groups each token may use")
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
    run.add_argument("--bias-update-speed", type=float, default=1e-3, help="glm4_moe: correction-bias step")
    run.add_argument("--log-every", type=int, default=50)
    run.add_argument("--threads", type=int, default=2,
                     help="torch threads; results are reproducible for one thread count (use 1 on a busy machine)")
    run.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    run.add_argument("--allow-large", action="store_true", help=f"write checkpoints over {MAX_CHECKPOINT_BYTES} bytes")
    args = p.parse_args(argv)
    for name, value in ARCH_DEFAULTS[args.arch].items():
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
    model = build_model(args, [text for _, text in train_docs])
    dtype = getattr(torch, args.save_dtype)
    size = checkpoint_bytes(model, dtype)
    print(f"model: {sum(p.numel() for p in model.parameters())} parameters, checkpoint {size / 1e6:.1f} MB", flush=True)
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
              "model": {"arch": args.arch, "parameters": sum(p.numel() for p in model.parameters())},
              "objective": objective_record(args),
              "versions": versions()}
    record["training"] = train(args, model, blocks)
    record["model"]["checkpoint_bytes"] = save_checkpoint(model, args.out, dtype)
    record["model"]["save_dtype"] = args.save_dtype
    record["heldout"] = heldout_loss(args.out, args.heldout_tokens, args.seq_len)
    if args.arch == "glm4_moe":
        biases = torch.stack([r.e_score_correction_bias.float() for r in routers_of(model)])  # [L, E]
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
    return {**common, "balancing": "aux-loss-free: e_score_correction_bias += speed * sign(mean load - load) "
            "per layer after each optimizer step; no auxiliary loss", "bias_update_speed": args.bias_update_speed}


def versions() -> Dict:
    import tokenizers
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine()}


if __name__ == "__main__":
    main()
