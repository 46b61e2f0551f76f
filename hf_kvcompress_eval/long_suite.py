"""The long-context suite's engine (``hf-kvcompress eval --suite long``, issue 36): every lossy method at several
budgets on the generated RULER-style tasks (`long_context`) and on the NLL of held-out real text after a long context,
against the full cache, sharing the work that does not depend on the method.

Per batch of samples (one task and length; every context exactly ``length`` tokens, so rows batch unpadded):
- one captured full prefill (`capture.capture`) serves every method that compresses after a prefill: each cache is
  filled from the captured states (`capture.replay`, which runs the layer's summary on the prefill's own queries as a
  one-shot prefill does; ``tests/evaluation/test_long_suite.py`` checks it against a real prefill bit for bit);
  methods named in ``own_prefill`` get a real prefill instead;
- KVzip's replay (the context re-fed after its repeat prompt, `methods.kvzip.replay`) runs once per batch, shared by
  the methods that use it (KVzip's scores, `summary_replay`'s scores and queries), and what it found prunes a fresh
  copy of the context for every method and budget (`methods.kvzip.prune`);
- answers are generated greedily (`generation.greedy_generate`), stopping at the end of the answer's line.

Rows go to ``results.jsonl`` as soon as a batch's method is done (one JSON object per sample and method: task,
length, seed, method, budget, score or NLL, held bytes per row by the cache's own count against the full cache's);
a rerun skips the rows already there. ``max_seconds`` stops after the first method (of a batch) that ends past
it, keeping what is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvcompress.generation import greedy_generate
from hf_kvcompress.kernels import dispatch
from hf_kvcompress.lossy.methods import METHODS, kvzip

from .capture import Captured, capture, replay
from .long_context import FILLER, TEXT_TASKS, Sample, make_sample, score
from .long_run import FULL, LongRun
from .lossy import captured_bytes, continuation_nll, lossy_setting, physical_bytes

FULL_CONFIG = (FULL, None)
NLL = "nll"
#: the key of a batch's context replay in `Engine.cache_for`'s ``scores``
REPLAY = "replay"
RESULTS = "results.jsonl"
#: new tokens per task: a 7-digit number after the answer prefix, its full stop and the line break are 10 SmolLM2
#: tokens, five variable names 26 (docs/results/long_context.md, "Full-cache scores (CPU)")
NEW_TOKENS = {"passkey": 10, "niah_single": 10, "niah_multikey": 10, "variable_tracking": 32, "niah_text": 10}


# ---------------------------------------------------------------------- samples in tokens


@dataclass
class Encoded:
    """One sample in token ids: ``context`` exactly ``length`` ids, then ``asked`` (question and answer prefix)."""

    sample: Sample
    length: int
    context: list[int]
    asked: list[int]


def encode(tokenizer, task: str, length: int, seed: int, text: str | None = None) -> Encoded:
    """Sample ``seed`` of ``task`` with a context of exactly ``length`` tokens: the generator fills to at most
    ``length`` (whole sentences), the rest is the end of the filler's repetition put before it. ``text``: the real
    text of `long_context.TEXT_TASKS`."""
    ids = _ids_counter(tokenizer)
    sample = make_sample(task, length, seed, lambda part: len(ids(part)), text)
    context = ids(sample.context)
    if len(context) > length:
        raise ValueError(f"long suite: a {task} context cannot be as short as {length} tokens (its least is "
                         f"{len(context)})")
    missing = length - len(context)
    if missing > 0:
        filler = ids(FILLER)
        filler = filler * (missing // len(filler) + 1)
        context = filler[len(filler) - missing :] + context
    return Encoded(sample, length, context, ids(sample.asked))


def _ids_counter(tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def batches(encoded: list[Encoded], size: int) -> list[list[Encoded]]:
    """Samples of one task and length grouped by question length (so a batch has no padding), ``size`` at most."""
    by_len: dict[int, list[Encoded]] = {}
    for e in encoded:
        by_len.setdefault(len(e.asked), []).append(e)
    return [group[i : i + size] for group in by_len.values() for i in range(0, len(group), size)]


def stop_ids(tokenizer) -> list[int]:
    """Token ids that end an answer: end of text, and every token holding a line break."""
    text = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    found = [i for i, t in enumerate(text) if "\n" in t]
    return sorted({*found, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})


# ---------------------------------------------------------------------- results file


class Results:
    """``results.jsonl``: one JSON row per sample and configuration, appended and flushed as they come."""

    def __init__(self, path: Path):
        self.path = path
        self.done: set[tuple] = set()
        self.scores: dict[tuple, list[float]] = {}
        if path.exists():
            data = path.read_bytes()
            # a run killed mid-write leaves a partial last line: dropped, the row is redone
            if data and not data.endswith(b"\n"):
                data = data[: data.rfind(b"\n") + 1]
                path.write_bytes(data)
            for line in data.decode().splitlines():
                self._add(json.loads(line))

    def has(self, key: tuple) -> bool:
        return key in self.done

    def write(self, rows: list[dict[str, Any]]) -> None:
        fresh = [row for row in rows if row_key(row) not in self.done]
        if not fresh:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.write("".join(json.dumps(row) + "\n" for row in fresh))
        for row in fresh:
            self._add(row)

    def _add(self, row: dict[str, Any]) -> None:
        self.done.add(row_key(row))
        if row.get("score") is not None:
            self.scores.setdefault((row["task"], row["length"], row["method"], row["budget"]), []).append(row["score"])

    def mean(self, key: tuple) -> float:
        """Mean score of ``(task, length, method, budget)`` over the rows there are (nan if none)."""
        values = self.scores.get(key)
        return sum(values) / len(values) if values else math.nan


def row_key(row: dict[str, Any]) -> tuple:
    return (row["task"], row["length"], row["seed"], row["method"], row["budget"])


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every complete row of a results file."""
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the last line may be cut short (a killed run)
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return out


# ---------------------------------------------------------------------- caches


@dataclass
class Engine:
    """A model with what every batch needs: the cache of each configuration, the KVzip repeat prompt, stop ids."""

    model: Any
    tokenizer: Any
    run: LongRun
    stops: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.device = next(self.model.parameters()).device
        #: methods that get a real prefill (``own_prefill``, and those `verify_prefill` finds the replay differs for)
        self.own = set(self.run.own_prefill)
        #: the real text of the NLL rows and of `long_context.TEXT_TASKS` (set by `run_long`)
        self.text: str | None = None
        self.repeat = torch.tensor(_ids_counter(self.tokenizer)(kvzip.REPEAT_PROMPT), device=self.device)
        self.stops = self.stops or stop_ids(self.tokenizer)
        #: the method whose cache runs the batch's context replay: one that keeps the replay's queries if the run has
        #: one (its replay serves the methods that read only the scores too)
        self.replay_donor = next((m for m in self.run.methods if m != FULL and METHODS[m].context_replay == "queries"),
                                 None) or next((m for m in self.run.methods if m != FULL
                                                and METHODS[m].context_replay is not None), None)
        self._encoded: dict[tuple[str, int, int], Encoded] = {}
        #: (method, budget) -> why it failed (`attempt`); methods run with the torch kernels; what happened
        self.errors: dict[tuple[str, str, float | None], str] = {}
        self.torch_kernels: set[str] = set()
        self.notes: list[str] = []

    def encoded(self, task: str, length: int, seed: int) -> Encoded:
        """`encode` once per sample (a run plans twice: the full cache first, then the lossy methods)."""
        key = (task, length, seed)
        if key not in self._encoded:
            self._encoded[key] = encode(self.tokenizer, task, length, seed, self.text)
        return self._encoded[key]

    def fresh(self, method: str, budget: float):
        r = self.run
        setting = lossy_setting(self.model, method, {"method": method}, budget, window=r.window, interval=r.interval,
                                sinks=r.sinks)
        return setting.make()

    def cache_for(self, method: str, budget: float | None, captured: Captured, ids: torch.Tensor,
                  scores: dict[str, kvzip.Replay]):
        """A cache holding the context ``ids`` (``[b, t]``, captured as ``captured``) for one configuration; ``scores``
        keeps what the batch's KVzip replay found (``scores[REPLAY]``, computed for the first configuration with
        ``context_replay``, reused by the others)."""
        if method == FULL:
            return replay(DynamicCache(), captured)
        if method in self.own:
            return self.prefilled(method, budget, ids)
        if METHODS[method].context_replay is not None:
            cache = self.shared(method, budget, captured, ids, hold=True)
            found = scores.get(REPLAY)
            wants_queries = METHODS[method].context_replay == "queries"
            if found is None or (wants_queries and found.queries[0] is None):
                # the replay forward once per batch, shared by every budget and every replay method: its scores do not
                # depend on the method (the context is held whole, `test_long_suite`); the reference queries are
                # sampled when a method of the run fits on them
                donor = self.shared(self.replay_donor, budget, captured, ids, hold=True) if (
                    not wants_queries and self.replay_donor != method) else cache
                found = scores[REPLAY] = kvzip.replay(self.model, donor, ids, self.repeat)
            kvzip.prune(cache, found.scores, found.queries if wants_queries else None)
            return cache
        return self.shared(method, budget, captured, ids)

    def attempt(self, task: str, method: str, budget: float | None, work: Callable[[], Any]) -> Any | None:
        """``work()`` for one configuration. On CUDA a failure is retried with the torch kernels (`kernels.dispatch`),
        kept for that method from then on; a configuration that still fails is recorded in ``errors``, said once
        on stderr and skipped for the rest of the run on that task (None): one failing method must not lose the
        others."""
        key = (task, method, budget)
        if key in self.errors:
            return None
        torch_kernels = method in self.torch_kernels
        try:
            with dispatch.forced("torch") if torch_kernels else contextlib.nullcontext():
                return work()
        except Exception as err:
            problem = f"{type(err).__name__}: {err}"
        if not torch_kernels and self.device.type == "cuda":
            try:
                with dispatch.forced("torch"):
                    out = work()
                self.torch_kernels.add(method)
                self.notes.append(f"{method}: torch kernels after {problem}")
                return out
            except Exception as err:
                problem += f"; with the torch kernels: {type(err).__name__}: {err}"
        self.errors[key] = problem
        print(f"long suite: {method} at budget {budget} failed on {task}, skipped there from here on: {problem}",
              file=sys.stderr)
        return None

    def shared(self, method: str, budget: float, captured: Captured, ids: torch.Tensor, *, hold: bool = False):
        """A cache at ``budget`` filled from the captured prefill (``hold``: KVzip's, summarising nothing yet), with
        the token ids a real prefill records (`CompressedCache.token_ids`: they count in its held bytes)."""
        cache = self.fresh(method, budget)
        if hold:
            with kvzip.hold_context(cache):
                replay(cache, captured)
        else:
            replay(cache, captured)
        cache.token_ids = ids.detach().cpu()
        return cache

    def prefilled(self, method: str, budget: float, ids: torch.Tensor):
        """A cache at ``budget`` after a real prefill of ``ids`` (KVzip's: `methods.kvzip.compress_context`)."""
        cache = self.fresh(method, budget)
        with torch.inference_mode():
            if METHODS[method].context_replay is not None:
                kvzip.compress_context(self.model, cache, ids, self.repeat)
            else:
                self.model(ids, cache=cache, logits_to_keep=1)
        return cache

    def verify_prefill(self, ids: torch.Tensor, methods: list[str], budget: float) -> dict[str, bool]:
        """Per method: whether the shared path (captured prefill replayed; KVzip's replay scores then prune) leaves
        the cache a real prefill leaves, bit for bit (every layer's held keys and values, held bytes). A method
        where it does not gets real prefills from here on."""
        captured = capture(self.model, ids)
        out = {}
        for method in methods:
            real = self.prefilled(method, budget, ids)
            if METHODS[method].context_replay is not None:
                mine = self.shared(method, budget, captured, ids, hold=True)
                found = kvzip.replay(self.model, mine, ids, self.repeat)
                kvzip.prune(mine, found.scores, found.queries)
            else:
                mine = self.shared(method, budget, captured, ids)
            out[method] = same_state(real, mine)
            if not out[method]:
                self.own.add(method)
        return out


def same_state(a, b) -> bool:
    """Whether two caches hold the same bits: every layer's keys and values, and the same held bytes."""
    if physical_bytes(a) != physical_bytes(b) or len(a.layers) != len(b.layers):
        return False
    for x, y in zip(a.layers, b.layers):
        for u, v in ((x.keys, y.keys), (x.values, y.values)):
            if u.shape != v.shape or u.dtype != v.dtype:
                return False
            if not torch.equal(u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)):
                return False
    return True


# ---------------------------------------------------------------------- one batch


def task_batch(engine: Engine, group: list[Encoded], configs, results: Results, clock: Clock, bar) -> bool:
    """Every configuration on one batch of task samples; False if the clock ran out first."""
    device = engine.device
    context = torch.tensor([e.context for e in group], device=device)
    prompt = torch.cat([context, torch.tensor([e.asked for e in group], device=device)], dim=-1)
    captured = capture(engine.model, context)
    full_bytes = captured_bytes(captured) / len(group)
    task, scores = group[0].sample.task, {}

    def answer(method: str, budget: float | None) -> tuple[float, list[str]]:
        cache = engine.cache_for(method, budget, captured, context, scores)
        held = physical_bytes(cache) / len(group)
        # the rows are equal-length (no padding): said outright, as generate cannot infer it when pad == eos
        run = greedy_generate(engine.model, prompt, cache, NEW_TOKENS[task], min_new_tokens=0,
                              attention_mask=torch.ones_like(prompt), eos_token_id=engine.stops,
                              pad_token_id=engine.stops[0])
        return held, engine.tokenizer.batch_decode(run.sequences[:, prompt.shape[1] :].cpu(), skip_special_tokens=True)

    for method, budget in configs:
        got = engine.attempt(task, method, budget, lambda m=method, b=budget: answer(m, b))
        if got is not None:
            held, texts = got
            results.write([{"task": task, "length": e.length, "seed": e.sample.seed, "method": method,
                            "budget": budget, "score": score(e.sample, text), "prediction": text, "held_bytes": held,
                            "full_bytes": full_bytes, "nll": None} for e, text in zip(group, texts)])
        bar.update(len(group))
        if clock.out():
            return False
    return True


def nll_batch(engine: Engine, windows: torch.Tensor, seeds: list[int], length: int, configs, results: Results,
              clock: Clock, bar) -> bool:
    """Every configuration's NLL of the continuation after ``length`` context tokens of ``windows``
    (``[b, length + continuation]``); False if the clock ran out first."""
    windows = windows.to(engine.device)
    cont = windows.shape[1] - length
    captured = capture(engine.model, windows, logits_to_keep=cont + 1)
    states = captured.slice(0, length)
    full_bytes = captured_bytes(states) / len(seeds)
    context, scores = windows[:, :length], {}

    def nll(method: str, budget: float | None) -> tuple[float, list[float]]:
        cache = engine.cache_for(method, budget, states, context, scores)
        held = physical_bytes(cache) / len(seeds)
        if method == FULL:
            losses = torch.nn.functional.cross_entropy(captured.logits[:, :-1].float().transpose(1, 2),
                                                       windows[:, length:], reduction="none")
        else:
            losses = continuation_nll(engine.model, cache, windows, length, engine.run.interval, captured.logits[:, 0])
        return held, losses.float().mean(dim=-1).cpu().tolist()

    for method, budget in configs:
        got = engine.attempt(NLL, method, budget, lambda m=method, b=budget: nll(m, b))
        if got is not None:
            held, per_row = got
            results.write([{"task": NLL, "length": length, "seed": seed, "method": method, "budget": budget,
                            "score": None, "prediction": None, "held_bytes": held, "full_bytes": full_bytes,
                            "nll": value} for seed, value in zip(seeds, per_row)])
        bar.update(len(seeds))
        if clock.out():
            return False
    return True


class Clock:
    """Seconds left of a run's ``max_seconds`` (None: no bound)."""

    def __init__(self, max_seconds: float | None):
        self.deadline = None if max_seconds is None else time.monotonic() + max_seconds

    def out(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


# ---------------------------------------------------------------------- the run


def text_windows(tokenizer, text: str, length: int, continuation: int, count: int) -> torch.Tensor:
    """``[count, length + continuation]`` ids: disjoint windows of ``text``, one after another from its start."""
    ids = _ids_counter(tokenizer)(text)
    size = length + continuation
    if len(ids) < count * size:
        raise ValueError(f"long suite: the NLL text has {len(ids)} tokens, {count} windows of {size} need "
                         f"{count * size}; pass a longer --text or fewer --nll-samples")
    return torch.tensor(ids[: count * size]).view(count, size)


def plan(engine: Engine, results: Results, text: str | None, task_configs: list, nll_configs: list,
         tasks_at: Callable[[int], list[str]] | None = None) -> list[tuple[str, Any, list]]:
    """The work left as ``(kind, item, configs)``, in rounds (a round is one batch of every task and length, then one
    of every NLL length), so a run stopped by its clock has about as many samples of each. ``tasks_at(length)``: the
    tasks to run at that length (default: all)."""
    run = engine.run
    queues: list[list[tuple[str, Any, list]]] = []
    for length in run.lengths if task_configs else ():
        for task in run.tasks if tasks_at is None else tasks_at(length):
            if task in TEXT_TASKS and text is None:
                continue  # no real text here (said once by `run_long`)
            todo = [seed for seed in range(run.count(length))
                    if any(not results.has((task, length, seed, m, b)) for m, b in task_configs)]
            encoded = [engine.encoded(task, length, seed) for seed in todo]
            queues.append([("task", group, task_configs) for group in batches(encoded, run.batch)])
    for length in run.nll_lengths if text is not None and nll_configs else ():
        todo = [seed for seed in range(run.nll_samples)
                if any(not results.has((NLL, length, seed, m, b)) for m, b in nll_configs)]
        if not todo:
            continue
        windows = text_windows(engine.tokenizer, text, length, run.continuation, run.nll_samples)
        queues.append([("nll", (length, todo[i : i + run.batch], windows[todo[i : i + run.batch]]), nll_configs)
                       for i in range(0, len(todo), run.batch)])
    rounds = max((len(q) for q in queues), default=0)
    return [q[i] for i in range(rounds) for q in queues if i < len(q)]


def run_long(engine: Engine, out: Path, *, text: str | None, progress: bool = True) -> dict[str, Any]:
    """Run what ``out/results.jsonl`` lacks: first the full cache on every task and length, then the lossy methods
    on the tasks the full cache scores at least ``min_full_score`` on, and the NLL rows. Returns ``{"rows_written",
    "stopped", "seconds", "prefill_check", "own_prefill", "left_out", "errors", "notes"}`` (``prefill_check``: method -> whether the
    shared prefill was bit for bit a real one; ``left_out``: ``"task@length"`` the lossy methods skipped)."""
    start = time.monotonic()
    run = engine.run
    engine.text = text
    missing = [t for t in run.tasks if t in TEXT_TASKS and text is None]
    if missing:
        print(f"WARNING: {', '.join(missing)} skipped: no real text (the NLL rows' text)", file=sys.stderr)
    results = Results(out / RESULTS)
    before = len(results.done)
    configs = run.configs()
    full = [c for c in configs if c[0] == FULL]
    lossy = [c for c in configs if c[0] != FULL]
    clock = Clock(run.max_seconds)
    stopped, checked, left_out = False, {}, []
    if full and lossy and run.min_full_score > 0:
        stopped = _run_work(engine, plan(engine, results, text, full, []), results, clock, progress, "full cache")

        def tasks_at(length: int) -> list[str]:
            kept = [t for t in run.tasks if results.mean((t, length, *FULL_CONFIG)) >= run.min_full_score]
            left_out.extend(f"{t}@{length}" for t in run.tasks if t not in kept)
            return kept

        work = [] if stopped else plan(engine, results, text, lossy, configs, tasks_at)
    else:
        work = plan(engine, results, text, configs, configs)
    check = [m for m in run.verify_prefill if m in run.methods and m != FULL and m not in engine.own]
    if check and work and run.budgets:
        kind, item, _ = work[0]
        ids = (torch.tensor([item[0].context]) if kind == "task" else item[2][:1, : item[0]]).to(engine.device)
        checked = engine.verify_prefill(ids, check, min(run.budgets))
    stopped = stopped or _run_work(engine, work, results, clock, progress, "long suite")
    return {"rows_written": len(results.done) - before, "stopped": stopped, "seconds": time.monotonic() - start,
            "prefill_check": checked, "own_prefill": sorted(engine.own), "left_out": left_out,
            "errors": {f"{t}/{m}@{b}": why for (t, m, b), why in engine.errors.items()}, "notes": engine.notes}


def _run_work(engine: Engine, work: list, results: Results, clock: Clock, progress: bool, name: str) -> bool:
    """Run ``work`` (`plan`); True if the clock stopped it."""
    total = sum(len(_seeds(kind, item)) * len(configs) for kind, item, configs in work)
    with tqdm(total=total, desc=name, unit="row", disable=not progress, mininterval=5) as bar:
        for kind, item, configs in work:
            todo = [c for c in configs if any(not results.has(_key(kind, item, c, s)) for s in _seeds(kind, item))]
            bar.update((len(configs) - len(todo)) * len(_seeds(kind, item)))
            if kind == "task":
                finished = task_batch(engine, item, todo, results, clock, bar)
            else:
                length, seeds, windows = item
                finished = nll_batch(engine, windows, seeds, length, todo, results, clock, bar)
            if not finished:
                return True
    return False


def _seeds(kind: str, item: Any) -> list[int]:
    return [e.sample.seed for e in item] if kind == "task" else item[1]


def _key(kind: str, item: Any, config: tuple[str, float | None], seed: int) -> tuple:
    task, length = (item[0].sample.task, item[0].length) if kind == "task" else (NLL, item[0])
    return (task, length, seed, *config)

