"""Held-out token windows of a trained checkpoint (benchmark/oea/models/*), for every study that
prompts or scores a trained model: the demo, the quality A/B, the router statistics, the frontier.

The held-out documents were never trained on (training/train_moe.py). They are encoded exactly as training
and held-out scoring encode them (train_moe.encode_stream: joined by EOS, EOS first), cut into
non-overlapping windows of `length` tokens, and `count` of those windows are picked by a seeded
permutation, so every caller with the same (model, length, count, seed) gets the same rows.
"""

import os
from typing import Dict, List

import torch

from training import train_moe


def heldout_stream(model_dir: str) -> torch.Tensor:
    """All held-out documents of `model_dir` as one token stream: [N] int64."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    documents = train_moe.read_heldout(os.path.join(model_dir, "heldout.txt"))
    return train_moe.encode_stream(tokenizer, [text for _, text in documents])


def heldout_windows(model_dir: str, count: int, length: int, seed: int = 0) -> torch.Tensor:
    """`count` distinct non-overlapping held-out windows of `length` tokens: [count, length] int64.

    Raises ValueError (naming the sizes) when the held-out text holds fewer than `count` windows.
    """
    blocks = train_moe.pack_blocks(heldout_stream(model_dir), length)
    if count < 1 or length < 2:
        raise ValueError(f"count must be >= 1 and length >= 2, got count={count} length={length}")
    if blocks.shape[0] < count:
        raise ValueError(f"{model_dir}/heldout.txt holds {blocks.shape[0]} windows of {length} tokens, "
                         f"fewer than the {count} asked for")
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(seed))
    return blocks[order[:count]].clone()


def prompt_continuations(model_dir: str, count: int, prompt_len: int, continuation_len: int,
                         seed: int = 0) -> List[Dict]:
    """`count` held-out (prompt, true continuation) pairs, as token ids:
    [{"prompt_ids": [prompt_len], "continuation_ids": [continuation_len]}, ...].

    Servers take the prompt as token ids (a completion's `prompt` may be a list of ids), so the
    prompt is exactly these tokens: decoding a window to text and tokenizing it again may not
    round-trip, since a window starts and ends mid-word.
    """
    windows = heldout_windows(model_dir, count, prompt_len + continuation_len, seed)
    return [{"prompt_ids": row[:prompt_len].tolist(), "continuation_ids": row[prompt_len:].tolist()}
            for row in windows]
