"""Prompt files of the A/B serving benchmark (--prompt-file) and the prompt count of each run.

A prompt file is the ShareGPT-format JSON list bench_serving's file datasets read:
[{"conversations": [{"value": PROMPT}, {"value": CONTINUATION}]}, ...]. The harness checks it before
any server starts, since bench_serving would silently send fewer prompts, or repeat a short one.
"""

import hashlib
import json
import os
from typing import List, Optional, Sequence, Tuple

from serving.servers import log

RANDOM_IDS = "random-ids"  # the `prompts` of a record measured without --prompt-file


def write_prompt_file(path: str, pairs: Sequence[Tuple[str, str]]) -> str:
    """(prompt, continuation) texts as the ShareGPT-format JSON list bench_serving's file datasets read:
    [{"id": "p<i>", "conversations": [{"from": "human", "value": prompt},
    {"from": "gpt", "value": continuation}]}, ...], one entry per pair. Returns path."""
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": cont}]}
            for i, (prompt, cont) in enumerate(pairs)]
    with open(path, "w") as f:
        json.dump(rows, f, indent=0)
    return path


def load_prompt_file(path: str) -> List[str]:
    """The prompts (first turns) of a ShareGPT-format file: [n] str. SystemExit naming --prompt-file
    when the file is missing, not JSON, or not a list of entries with two turns whose first is non-empty
    (bench_serving would skip such an entry without a word)."""
    def fail(why: str):
        raise SystemExit(f"--prompt-file {path}: {why}")

    try:
        with open(path) as f:
            rows = json.load(f)
    except OSError as e:
        fail(f"cannot read it ({e.strerror})")
    except ValueError as e:
        fail(f"not JSON ({e})")
    if not isinstance(rows, list) or not rows:
        fail('expected a non-empty JSON list of {"conversations": [{"value": PROMPT}, {"value": ...}]}')
    prompts = []
    for i, row in enumerate(rows):
        turns = row.get("conversations") if isinstance(row, dict) else None
        if (not isinstance(turns, list) or len(turns) < 2
                or not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2])
                or not turns[0]["value"]):
            fail(f'entry {i} is not {{"conversations": [{{"value": PROMPT}}, {{"value": ...}}]}} '
                 "with a non-empty PROMPT")
        prompts.append(turns[0]["value"])
    return prompts


def token_counts(tokenizer: str, prompts: Sequence[str]) -> Optional[List[int]]:
    """Tokens per prompt as bench_serving counts them (the tokenizer's encode): [n] int, or None
    when transformers cannot load the tokenizer."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:  # noqa: BLE001 - only a check; bench_serving loads it its own way
        log(f"--prompt-file: could not load tokenizer {tokenizer} ({type(e).__name__}); prompt lengths unchecked")
        return None
    return [len(tok.encode(p)) for p in prompts]


def check_prompt_file(args) -> str:
    """Validate --prompt-file for this sweep; returns its label for results.jsonl, 'NAME sha256:HEX12'.

    Every run (the warm-up too) must find enough prompts in it, since bench_serving would silently
    send fewer, and every prompt must hold at least --input-len tokens, since bench_serving would
    repeat a shorter one to fill. SystemExit naming --prompt-file otherwise.
    """
    path = args.prompt_file
    prompts = load_prompt_file(path)
    needed = max([num_prompts_for(c, args) for c in args.concurrency] + [args.warmup_prompts]
                 + [switch_warmup_prompts(c, args) for c in args.concurrency])
    if len(prompts) < needed:
        raise SystemExit(f"--prompt-file {path}: {len(prompts)} prompts, but a run of this sweep sends {needed} "
                         "(lower --concurrency/--prompts-per-concurrency/--num-prompts or give more prompts)")
    counts = token_counts(args.tokenizer, prompts)
    short = [i for i, n in enumerate(counts or []) if n < args.input_len]
    if short:
        raise SystemExit(f"--prompt-file {path}: {len(short)} prompt(s) (entry {short[0]} first, "
                         f"{counts[short[0]]} tokens) shorter than --input-len {args.input_len}")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return f"{os.path.basename(path)} sha256:{digest}"


def num_prompts_for(concurrency: int, args) -> int:
    """Prompts of one run at `concurrency`: --num-prompts, else max(--prompts-per-concurrency * C, --min-prompts)."""
    if args.num_prompts:
        return args.num_prompts
    return max(args.prompts_per_concurrency * concurrency, args.min_prompts)


def switch_warmup_prompts(concurrency: int, args) -> int:
    """Prompts of the one-server sweep's warm-up at `concurrency`: --switch-warmup-prompts, else one
    wave at the run's concurrency, min(C, the run's own prompt count); 0 = no warm-up."""
    if args.switch_warmup_prompts is not None:
        return args.switch_warmup_prompts
    return min(concurrency, num_prompts_for(concurrency, args))
