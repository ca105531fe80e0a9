"""The trial's one budget (trial.py --budget-minutes): throughput, the accept-length probe and
quality together, planned before any load and cut to fit.

Work per phase (Work), known before any load; A = 1 + the number of k0 (the arms), L = --output-len:
- throughput: at each open concurrency C, blocks of A bench runs of P(C) prompts x L tokens; one
  block at least, --max-repeats at most;
- accept length (speculative decoding only): at each open C, A arms of at least its floor of
  prompts x L tokens, then more rounds until its paired interval clears the bound;
- quality: at each quality concurrency, A arms of the task (quality-ab: its prompts x
  --quality-max-tokens, an upper bound since EOS ends them; lm-eval: --lm-eval-limit documents x
  LM_EVAL_TOKENS when given, else unknown until its first arm has run).

Time = output tokens / the server's output tok/s at that concurrency (Speed), measured by the
trial's own runs as they come (the start-up warm-up first). Where no run was measured at C: tok/s
proportional to C below the smallest measured concurrency (a decode step as long as there), the
largest measured one's above it (no gain from a larger batch), linear in between; the first two
err towards the longer estimate.

What gives way, in order: throughput blocks past the first at each concurrency (throughput may use
the time left minus the two reserves below), accept-length rounds past the floor (the accept reserve:
its floor, at least ACCEPT_SHARE of the budget), then quality at its largest concurrency (run only
when its estimate fits what is left). Never cut, since a verdict needs them: one block per open
concurrency, the accept floor, quality at its first concurrency. When even those do not fit, the
plan says so and the trial runs them anyway. Every cut is recorded (Budget.cuts) for the report.
"""

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from serving.prompt_files import num_prompts_for
from serving.quality_inputs import load_prompts
from serving.servers import log

ACCEPT_SHARE = 0.25  # the accept-length probe's reserve: at least this share of the budget
LM_EVAL_TOKENS = 256  # tokens per lm-eval sample assumed for the estimate (lm-eval's default max_gen_toks)


class Speed:
    """Output tok/s per concurrency, from the trial's measured runs."""

    def __init__(self):
        self.samples: Dict[int, List[float]] = {}  # C -> [tok/s, ...]
        self.source: Optional[str] = None  # what gave the first figure

    def add(self, conc: int, tok_s: Optional[float], source: str) -> None:
        if tok_s and tok_s > 0 and conc > 0:
            self.samples.setdefault(conc, []).append(float(tok_s))
            self.source = self.source or f"{tok_s:.0f} tok/s at C={conc} ({source})"

    def at(self, conc: int) -> Optional[float]:
        """tok/s at conc (see the module doc for concurrencies not measured); None before any run."""
        known = sorted((c, statistics.median(v)) for c, v in self.samples.items())
        if not known:
            return None
        if conc <= known[0][0]:
            return known[0][1] * conc / known[0][0]
        if conc >= known[-1][0]:
            return known[-1][1]
        (c0, s0), (c1, s1) = next((a, b) for a, b in zip(known, known[1:]) if a[0] <= conc <= b[0])
        return s0 + (s1 - s0) * (conc - c0) / (c1 - c0)

    def seconds(self, conc: int, requests: int, tokens: int) -> Optional[float]:
        """Seconds for `requests` requests of `tokens` output tokens each at concurrency conc."""
        tok_s = self.at(conc)
        return requests * tokens / tok_s if tok_s else None


@dataclass
class Work:
    """What each phase will send (see the module doc)."""

    arms: int
    output_len: int
    throughput: List[Tuple[int, int]]  # (C, prompts per run) at each open concurrency
    max_repeats: int
    accept: List[Tuple[int, int]] = field(default_factory=list)  # (C, floor prompts); [] without speculation
    quality: List[Tuple[int, Optional[int], int, str]] = field(default_factory=list)  # (C, samples, tokens, why)
    quality_what: str = ""


def minutes(seconds: Optional[float]) -> str:
    return "?" if seconds is None else f"{seconds / 60:.1f} min"


class Budget:
    """--budget-minutes for the whole trial: the clock, the speed, the reserves and the cuts."""

    def __init__(self, budget_minutes: float, work: Work, clock: Callable[[], float] = time.time):
        self.seconds, self.work, self.clock = 60.0 * budget_minutes, work, clock
        self.started = clock()
        self.speed = Speed()
        self.cuts: List[str] = []
        self.phases: Dict[str, Dict[str, float]] = {}  # name -> {"started", "seconds"}
        self.quality_arm_s: Dict[int, float] = {}  # C -> seconds of one measured quality arm
        self.plan: List[str] = []  # the last plan printed
        self.announced = False

    # ------------------------------------------------------------------ estimates

    def block_s(self, conc: int, prompts: int) -> Optional[float]:
        one = self.speed.seconds(conc, prompts, self.work.output_len)
        return None if one is None else self.work.arms * one

    def throughput_min_s(self) -> Optional[float]:
        blocks = [self.block_s(c, p) for c, p in self.work.throughput]
        return None if None in blocks else sum(blocks)

    def accept_floor_s(self) -> Optional[float]:
        runs = [self.speed.seconds(c, n, self.work.output_len) for c, n in self.work.accept]
        return None if None in runs else self.work.arms * sum(runs)

    def quality_s(self, conc: int) -> Optional[float]:
        """One quality concurrency's estimate: a measured arm's time (scaled by speed from another
        concurrency), else its samples x tokens."""
        if conc in self.quality_arm_s:
            return self.work.arms * self.quality_arm_s[conc]
        for c, arm_s in self.quality_arm_s.items():
            here, there = self.speed.at(conc), self.speed.at(c)
            if here and there:
                return self.work.arms * arm_s * there / here
        samples, tokens = next(((n, t) for c, n, t, _ in self.work.quality if c == conc), (None, 0))
        one = self.speed.seconds(conc, samples, tokens) if samples else None
        return None if one is None else self.work.arms * one

    def quality_reserve_s(self) -> float:
        """The time kept for the quality runs not cut (unknown ones count 0)."""
        cut = set(self.cut_quality)
        return sum(self.quality_s(c) or 0.0 for c, *_ in self.work.quality if c not in cut)

    def accept_reserve_s(self) -> float:
        if not self.work.accept:
            return 0.0
        return max(self.accept_floor_s() or 0.0, ACCEPT_SHARE * self.seconds)

    # ------------------------------------------------------------------ the clock

    def left(self) -> float:
        """Seconds left of the whole budget (negative when over)."""
        return self.started + self.seconds - self.clock()

    def throughput_left(self) -> float:
        """Seconds throughput may still use: what is left after the accept and quality reserves."""
        return self.left() - self.accept_reserve_s() - self.quality_reserve_s()

    def accept_left(self) -> float:
        """Seconds the accept-length probe may still use: what is left after the quality reserve."""
        return self.left() - self.quality_reserve_s()

    @property
    def cut_quality(self) -> List[int]:
        return [c for c, *_ in self.work.quality if any(cut.startswith(f"quality at C={c} ") for cut in self.cuts)]

    def quality_fits(self, conc: int, first: bool) -> bool:
        """Whether quality at conc runs: always the first quality concurrency, another only when its
        estimate fits what is left (recorded as a cut otherwise)."""
        need = self.quality_s(conc)
        if first or need is None or need <= self.left():
            return True
        self.cut(f"quality at C={conc} (about {minutes(need)}, {minutes(max(self.left(), 0))} of the budget left)")
        return False

    def cut(self, what: str) -> None:
        self.cuts.append(what)
        log(f"budget: cut {what}")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times one phase for the report (also when it ends in an error or an interrupt)."""
        started = self.clock()
        try:
            yield
        finally:
            self.phases[name] = {"started": started, "seconds": self.clock() - started}

    # ------------------------------------------------------------------ the plan

    def plan_lines(self) -> List[str]:
        """The plan: one line per phase with its estimate, then what will be cut to fit."""
        w, speed = self.work, self.speed.source
        lines = [f"budget: {self.seconds / 60:g} min for the whole trial (throughput, accept length, quality); "
                 + (f"times from {speed}" if speed else "times follow once the first run has measured the speed")]
        concs = ", ".join(str(c) for c, _ in w.throughput)
        one, blocks = self.throughput_min_s(), self.blocks_that_fit()
        fit = "" if blocks is None else (f"; about {blocks} block(s) per concurrency fit"
                                         + (" (a resolved cell needs 3)" if blocks < 3 else ""))
        lines.append(f"throughput: blocks of {w.arms} runs at C={concs}, one block per concurrency at least "
                     f"({minutes(one)}), at most {w.max_repeats}; more blocks until resolved, within the time the "
                     f"steps below leave{fit}")
        if w.accept:
            floor = ", ".join(f"{n} prompts at C={c}" for c, n in w.accept)
            lines.append(f"accept length: {w.arms} arms of at least {floor} ({minutes(self.accept_floor_s())}"
                         f"), then more until the paired interval clears the bound, within "
                         f"{minutes(self.accept_reserve_s())} and what throughput leaves")
        for c, samples, tokens, why in w.quality:
            size = (f"{samples} samples x up to {tokens} tokens" if samples else
                    "its size is known once its first arm has run (give --lm-eval-limit to size it)")
            lines.append(f"quality ({w.quality_what}) at C={c}, {why}: {w.arms} arms, {size} "
                         f"({minutes(self.quality_s(c))})")
        return lines + [self.cut_line()]

    def blocks_that_fit(self) -> Optional[int]:
        """Throughput blocks per concurrency that fit the budget after the reserves (None: unknown)."""
        one = self.throughput_min_s()
        if not one:
            return None
        room = self.seconds - self.accept_reserve_s() - self.quality_reserve_s()
        return max(0, min(self.work.max_repeats, int(room // one)))

    def cut_line(self) -> str:
        """What will be cut to fit, from the estimates (unknown estimates count 0)."""
        w = self.work
        first_quality = (self.quality_s(w.quality[0][0]) or 0.0) if w.quality else 0.0
        minimum = (self.throughput_min_s() or 0.0) + (self.accept_floor_s() or 0.0) + first_quality
        cuts = []
        if len(w.quality) > 1:
            extra = sum(self.quality_s(c) or 0.0 for c, *_ in w.quality[1:])
            if minimum + extra > self.seconds:
                cuts.append(f"quality at C={', '.join(str(c) for c, *_ in w.quality[1:])}")
        blocks = self.blocks_that_fit()
        if blocks is not None and blocks < w.max_repeats:
            cuts.append(f"throughput blocks past {max(blocks, 1)} per concurrency")
        line = "to fit: " + ("; ".join(cuts) + " will be cut" if cuts else "nothing is cut")
        if minimum > self.seconds:
            line += (f"; the minimum (one block per concurrency, the accept floor, quality at its first "
                     f"concurrency) needs about {minimum / 60:.1f} min, over the budget: it runs anyway")
        return line

    def announce(self) -> None:
        """Print the plan once the speed is known (the preflight printed it without times)."""
        if self.announced or self.speed.source is None:
            return
        self.announced = True
        self.plan = self.plan_lines()
        log("plan, now that the speed is measured:\n  " + "\n  ".join(self.plan))

    def as_dict(self) -> Dict:
        """results.json's "budget"."""
        return {"minutes": self.seconds / 60, "plan": self.plan or self.plan_lines(), "cuts": list(self.cuts),
                "phases": {name: round(p["seconds"] / 60, 2) for name, p in self.phases.items()},
                "used_minutes": round((self.clock() - self.started) / 60, 2)}


def share_of(time_left: Callable[[], float], parts_left: int, clock: Callable[[], float] = time.time
             ) -> Callable[[], float]:
    """Seconds the first of `parts_left` parts (concurrencies) may still use: its share of what
    time_left() gave when it started (re-read each time, since the reserves change as the speed is
    measured), less what it has spent since."""
    t0 = clock()

    def left() -> float:
        spent = clock() - t0
        return (time_left() + spent) / parts_left - spent
    return left


def work_of(args, pre, sargs, quality_at: Sequence[Dict]) -> Work:
    """The trial's Work from its flags (args), the preflight (pre), the sweep's namespace (sargs)
    and the quality concurrencies ([{"concurrency", "why", ...}], quality.quality_concurrencies)."""
    opened = pre.open_concurrencies
    quality, what = [], ""
    for q in quality_at:
        if args.quality == "quality-ab":
            samples, tokens = len(load_prompts(args.quality_prompts)), args.quality_max_tokens
            what = f"quality_ab, {args.quality_prompts}"
        else:
            tasks = len([t for t in (args.lm_eval_task or "").split(",") if t.strip()]) or 1
            samples, tokens = (args.lm_eval_limit * tasks if args.lm_eval_limit else None), LM_EVAL_TOKENS
            what = f"lm-eval {args.lm_eval_task}"
        quality.append((q["concurrency"], samples, tokens, q["why"]))
    return Work(arms=1 + len(args.k0), output_len=args.output_len,
                throughput=[(c, num_prompts_for(c, sargs)) for c in opened], max_repeats=args.max_repeats,
                accept=[(c, max(args.accept_prompts, 2 * c)) for c in opened] if pre.speculative else [],
                quality=quality, quality_what=what)
