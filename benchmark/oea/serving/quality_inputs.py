"""The prompts of the quality A/B (quality_ab.py --prompts): a JSONL file, one object a line.

    {"prompt": str | [token id, ...], "answer": str | number (optional),
     "answer_regex": str (optional), "reference_ids": [token id, ...] (optional)}

A prompt given as token ids is sent as ids, so the server sees exactly those tokens. Every problem
raises InputError naming the file and line (or the flag).
"""

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Pattern, Sequence, Tuple, Union


class InputError(ValueError):
    """Bad user input (file, JSONL line, regex, flag); main prints it and exits with 2."""


Prompt = Union[str, Tuple[int, ...]]  # text, or token ids sent as ids


@dataclass(frozen=True)
class Item:
    """One prompt; `answer` None when it has none, `reference` (true continuation ids) None likewise."""

    prompt: Prompt
    answer: Optional[str] = None
    regex: Optional[Pattern] = None
    reference: Optional[Tuple[int, ...]] = None


def compile_regex(text: object, where: str) -> Pattern:
    """`text` compiled; InputError naming `where` when it is not a valid regex string."""
    if not isinstance(text, str):
        raise InputError(f"{where}: must be a string, got {type(text).__name__}")
    try:
        return re.compile(text)
    except re.error as e:
        raise InputError(f"{where}: invalid regex {text!r}: {e}") from None


def token_ids(value: object) -> Optional[Tuple[int, ...]]:
    """`value` as a tuple of token ids when it is a non-empty list of non-negative ints, else None."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    return tuple(value)


def parse_prompt(value: object, where: str) -> Prompt:
    """A line's 'prompt': a non-empty string, or a non-empty list of token ids (tuple)."""
    if isinstance(value, str) and value:
        return value
    ids = token_ids(value)
    if ids is None:
        raise InputError(f"{where}: field 'prompt' must be a non-empty string or a non-empty list of "
                         "token ids (integers >= 0)")
    return ids


def parse_item(line: str, where: str, default_regex: Optional[Pattern]) -> Item:
    """One JSONL line; `where` is 'FILE:LINE' for the error messages."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt = parse_prompt(obj.get("prompt"), where)
    answer = obj.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise InputError(f"{where}: field 'answer' must be a string or a number")
    regex = default_regex
    if "answer_regex" in obj:
        regex = compile_regex(obj["answer_regex"], f"{where}: field 'answer_regex'")
    reference = None
    if "reference_ids" in obj:
        reference = token_ids(obj["reference_ids"])
        if reference is None:
            raise InputError(f"{where}: field 'reference_ids' must be a non-empty list of token ids (integers >= 0)")
    return Item(prompt, None if answer is None else str(answer), regex, reference)


def load_prompts(path: str, default_regex: Optional[Pattern] = None) -> List[Item]:
    """The items of a JSONL file (blank lines skipped); InputError on any problem."""
    if not os.path.isfile(path):
        raise InputError(f"--prompts: no such file: {path}")
    with open(path, encoding="utf-8") as f:
        items = [parse_item(line, f"{path}:{n}", default_regex) for n, line in enumerate(f, 1) if line.strip()]
    if not items:
        raise InputError(f"--prompts: {path} holds no prompts")
    return items


def prompts_digest(items: Sequence[Item]) -> str:
    """sha256 of the prompts (texts or id lists) in order: ties a saved arm to its prompts."""
    return hashlib.sha256(json.dumps([it.prompt for it in items]).encode()).hexdigest()
