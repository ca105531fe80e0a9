"""The trial's prompts (trial.py): the operator's --prompt-file, or a clearly labelled default.

Both end as a ShareGPT-format prompt file (serving/prompt_files.py) that bench_serving's `random`
dataset reads: each prompt is cut to --input-len tokens and sent as token ids. A prompt shorter
than --input-len would be repeated to fill, so prompts that short are left out (a copy of the file
without them is written into --out-dir, and the report says how many were kept).

The default, without --prompt-file: windows of real text rather than random token ids (a router
routes random ids unlike any real text, and OEA's saving depends on how its choices overlap). With
a model directory that holds heldout.txt (this project's trained checkpoints), its held-out text;
else the Python standard library's source files of this interpreter. From either, the first window
of each document, then the next windows of each when more prompts are needed than there are
documents. Neither is your traffic, and the report says so.
"""

import json
import os
import random
from typing import List, Optional, Set, Tuple

from serving.prompt_files import token_counts, load_prompt_file, write_prompt_file

DEFAULT_SEED = 0
WINDOW_MARGIN = 16  # extra tokens per default window: text decoded from ids may tokenize a little shorter


def default_documents(tokenizer: str) -> Tuple[List[str], str]:
    """(texts, label) of the default prompts: the model's held-out documents, or the standard library."""
    from training import train_moe  # the corpus readers of the trained checkpoints (imports torch)

    heldout = os.path.join(tokenizer, "heldout.txt")
    if os.path.isfile(heldout):
        return ([text for _, text in train_moe.read_heldout(heldout)],
                f"default: held-out text of {os.path.basename(os.path.normpath(tokenizer))} (heldout.txt, documents "
                "it never trained on); not your traffic: pass --prompt-file")
    return ([text for _, text in train_moe.list_documents(train_moe.stdlib_root())],
            "default: Python standard-library source windows; not your traffic: pass --prompt-file with prompts "
            "like the ones you serve")


def write_default_prompts(tokenizer: str, path: str, count: int, input_len: int, wanted: int = 0) -> str:
    """`count` windows of input_len + WINDOW_MARGIN tokens (up to `wanted` when the text holds them:
    the accept-length probe draws fresh prompts until resolved), the first of each document in a
    seeded order, then, when there are fewer long documents than that (a trained checkpoint's
    held-out text holds a few dozen), each document's next windows (later_windows); as a prompt file
    at `path`; returns its label. SystemExit naming --prompt-file when there are fewer than `count`."""
    from transformers import AutoTokenizer

    texts, label = default_documents(tokenizer)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    order = list(range(len(texts)))
    random.Random(DEFAULT_SEED).shuffle(order)
    size, target = input_len + WINDOW_MARGIN, max(count, wanted)
    pairs = []
    for i in order:
        ids = tok.encode(texts[i][:40 * size], add_special_tokens=False)
        if len(ids) >= size:
            pairs.append((tok.decode(ids[:size]), ""))
        if len(pairs) == target:
            break
    if len(pairs) < target:
        pairs += later_windows(tok, [texts[i] for i in order], size, target - len(pairs), {p for p, _ in pairs})
    if len(pairs) < count:
        raise SystemExit(f"--prompt-file: the default prompts hold {len(pairs)} windows of {input_len} tokens, "
                         f"fewer than the {count} this trial sends; pass --prompt-file or lower --input-len")
    write_prompt_file(path, pairs)
    return label


def later_windows(tok, texts: List[str], size: int, wanted: int, seen: Set[str]) -> List[Tuple[str, str]]:
    """Up to `wanted` more (prompt, "") windows of `size` tokens: the second window of each text in
    order, then the third, and so on; a text's windows follow each other, after its first. A window
    whose text is in `seen` or already taken (repeated source lines) is left out."""
    per_text = [tok.encode(text, add_special_tokens=False, verbose=False) for text in texts]
    out: List[Tuple[str, str]] = []
    seen = set(seen)
    for k in range(1, max((len(ids) // size for ids in per_text), default=0)):
        for ids in per_text:
            window = tok.decode(ids[k * size:(k + 1) * size]) if (k + 1) * size <= len(ids) else None
            if window is not None and window not in seen:
                seen.add(window)
                out.append((window, ""))
                if len(out) == wanted:
                    return out
    return out


def usable_prompt_file(path: str, tokenizer: str, input_len: int, needed: int, out_dir: str) -> Tuple[str, str]:
    """(the file the bench reads, its label): `path` itself when every prompt holds at least input_len
    tokens, else a copy in out_dir without the shorter ones. SystemExit naming --prompt-file when
    fewer than `needed` prompts are long enough."""
    prompts = load_prompt_file(path)
    counts = token_counts(tokenizer, prompts)
    if counts is None:
        return path, f"{path} (prompt lengths unchecked: the tokenizer did not load)"
    keep = [i for i, n in enumerate(counts) if n >= input_len]
    if len(keep) < needed:
        raise SystemExit(f"--prompt-file {path}: {len(keep)} of {len(prompts)} prompts hold at least --input-len "
                         f"{input_len} tokens, and a run of this trial sends {needed}; lower --input-len or add "
                         "prompts")
    if len(keep) == len(prompts):
        return path, f"{path} ({len(prompts)} prompts)"
    with open(path) as f:
        rows = json.load(f)
    kept = os.path.join(out_dir, f"prompts_min{input_len}.json")
    with open(kept, "w") as f:
        json.dump([rows[i] for i in keep], f, indent=0)
    return kept, (f"{path}: the {len(keep)} of {len(prompts)} prompts with at least {input_len} tokens "
                  f"(copied to {os.path.basename(kept)})")


def trial_prompt_file(prompt_file: Optional[str], tokenizer: str, input_len: int, needed: int,
                      out_dir: str, wanted: int = 0) -> Tuple[str, str]:
    """(prompt file path, label) for the trial: the operator's file (usable_prompt_file) or the
    default (up to `wanted` prompts when there are that many windows, `needed` at least)."""
    if prompt_file:
        return usable_prompt_file(os.path.abspath(prompt_file), tokenizer, input_len, needed, out_dir)
    path = os.path.join(out_dir, "default_prompts.json")
    return path, write_default_prompts(tokenizer, path, needed, input_len, wanted)


def prompt_texts(path: str, count: Optional[int] = None) -> List[str]:
    """The first `count` prompts (first turns; None: all) of a prompt file: the accept-length probe's."""
    return load_prompt_file(path)[:count]
