"""The long-context suite's engine and report (issue 36): exact-length samples, the shared prefill bit for bit a real
one for every method, KVzip's replay once per batch, one prefill per batch, resumable rows, the time bound, the
report's statistics; and a tiny CLI smoke of ``hf-kvcompress eval --suite long``."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import fresh_tiny_model
from transformers import AutoTokenizer

from hf_kvcompress.cli import main
from hf_kvcompress.lossy.methods import METHODS, kvzip
from hf_kvcompress_eval import long_suite
from hf_kvcompress_eval.capture import capture
from hf_kvcompress_eval.long_context import TASKS
from hf_kvcompress_eval.long_report import kept_tasks, markdown, mean_se, summarise
from hf_kvcompress_eval.long_suite import (
    FULL,
    NLL,
    Clock,
    Engine,
    LongRun,
    Results,
    batches,
    encode,
    same_state,
    task_batch,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets[0])


@pytest.fixture(scope="module")
def engine(tokenizer):
    # six layers: a per-layer difference between the shared and the real prefill cannot hide behind two
    model = fresh_tiny_model("llama-gqa", layers=6)
    run = LongRun(lengths=(96,), samples=(2,), budgets=(0.5, 0.25), window=8, sinks=2, interval=16)
    return Engine(model, tokenizer, run)


@pytest.mark.parametrize("task", TASKS)
def test_samples_encode_to_exactly_the_asked_length(tokenizer, tiny_assets, task):
    text = tiny_assets[1].read_text()
    one = encode(tokenizer, task, 300, 3, text)
    assert len(one.context) == 300
    assert one.context == encode(tokenizer, task, 300, 3, text).context
    text = tokenizer.decode(one.context)
    assert all(answer in text for answer in one.sample.answers)
    assert tokenizer.decode(one.asked).endswith(one.sample.answer_prefix)


def test_every_task_has_an_answer_length():
    assert set(long_suite.NEW_TOKENS) == set(TASKS)


def test_batches_hold_equally_long_questions(tokenizer):
    encoded = [encode(tokenizer, "niah_single", 200, seed) for seed in range(9)]
    groups = batches(encoded, 2)
    assert sorted(e.sample.seed for g in groups for e in g) == list(range(9))
    assert all(len(g) <= 2 and len({len(e.asked) for e in g}) == 1 for g in groups)


def test_the_shared_prefill_is_a_real_prefill_bit_for_bit(engine):
    ids = torch.randint(3, 100, (2, 80), generator=torch.Generator().manual_seed(1))
    checked = engine.verify_prefill(ids, list(METHODS), 0.25)
    assert checked == dict.fromkeys(METHODS, True)
    assert not engine.own


def test_same_state_sees_one_flipped_bit(engine):
    ids = torch.randint(3, 100, (1, 80), generator=torch.Generator().manual_seed(2))
    a, b = (engine.prefilled("snapkv", 0.25, ids) for _ in range(2))
    assert same_state(a, b)
    b.layers[3].residual_keys.view(torch.int32)[0, 0, -1, 0] ^= 1
    assert not same_state(a, b)


def test_one_prefill_and_one_kvzip_replay_per_batch(engine, tokenizer, tmp_path, monkeypatch):
    group = [encode(tokenizer, "passkey", 200, seed) for seed in range(2)]
    configs = [(FULL, None)] + [(m, b) for m in ("snapkv", "summary", "kvzip") for b in (0.5, 0.25)]
    forwards, replays = [], []
    handle = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(kwargs.get("input_ids", args[0] if args else None).shape[-1]),
        with_kwargs=True)
    found = kvzip.replay
    monkeypatch.setattr(kvzip, "replay", lambda *a, **k: replays.append(1) or found(*a, **k))
    results = Results(tmp_path / "r.jsonl")
    try:
        assert task_batch(engine, group, configs, results, Clock(None), _Bar())
    finally:
        handle.remove()
    assert forwards.count(200) == 1  # the captured context prefill, shared by every configuration
    assert len(replays) == 1  # KVzip's replay forward (repeat prompt + context) once, for both budgets
    assert forwards.count(200 + len(engine.repeat)) == 1
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(configs)
    for row in rows:
        assert row["held_bytes"] <= (row["budget"] or 1.0) * row["full_bytes"] * 1.02  # token ids, block counts
    # the pruned copies are what compress_context leaves at each budget
    for budget in (0.5, 0.25):
        real = engine.prefilled("kvzip", budget, torch.tensor([e.context for e in group]))
        kept = {r["held_bytes"] for r in rows if r["method"] == "kvzip" and r["budget"] == budget}
        assert kept == {long_suite.physical_bytes(real) / 2}


def test_generation_is_told_the_rows_are_unpadded(engine, tokenizer, tmp_path, monkeypatch):
    # pad == eos for these models: without a mask generate warns that it cannot tell padding apart and guesses
    group = [encode(tokenizer, "passkey", 200, seed) for seed in range(2)]
    masks, found = [], long_suite.greedy_generate
    monkeypatch.setattr(long_suite, "greedy_generate",
                        lambda model, ids, *a, **k: masks.append((ids.shape, k.get("attention_mask")))
                        or found(model, ids, *a, **k))
    assert task_batch(engine, group, [(FULL, None), ("kvzip", 0.5)], Results(tmp_path / "r.jsonl"), Clock(None),
                      _Bar())
    assert len(masks) == 2
    for shape, mask in masks:
        assert mask is not None and mask.shape == shape and bool(mask.all())


def test_one_replay_serves_kvzip_and_summary_replay_bit_for_bit(engine, monkeypatch):
    # the batch's replay runs once for both methods and both budgets (in either order); every pruned copy is what
    # the method's own compress_context leaves
    ids = torch.randint(3, 100, (2, 90), generator=torch.Generator().manual_seed(4))
    captured = capture(engine.model, ids)
    replays = []
    found = kvzip.replay
    monkeypatch.setattr(kvzip, "replay", lambda *a, **k: replays.append(1) or found(*a, **k))
    for order in (("kvzip", "summary_replay"), ("summary_replay", "kvzip")):
        replays.clear()
        scores = {}
        for method in order:
            for budget in (0.5, 0.25):
                mine = engine.cache_for(method, budget, captured, ids, scores)
                monkeypatch.setattr(kvzip, "replay", found)
                real = engine.prefilled(method, budget, ids)
                monkeypatch.setattr(kvzip, "replay", lambda *a, **k: replays.append(1) or found(*a, **k))
                assert same_state(mine, real), (method, budget)
        assert len(replays) == 1, order


def test_a_crop_frees_the_cropped_token_ids(engine):
    # kvzip.compress_context crops its replay off: the cache's token ids were a view pinning the replay's ids too
    ids = torch.randint(3, 100, (2, 80), generator=torch.Generator().manual_seed(3))
    cache = engine.prefilled("kvzip", 0.25, ids)
    assert torch.equal(cache.token_ids, ids)
    assert cache.stats()["token_ids_bytes"] == ids.numel() * 8


def test_a_failing_method_is_reported_and_skipped(engine, capsys):
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("no kernel")

    assert engine.attempt("passkey", "tova", 0.5, boom) is None
    assert engine.attempt("passkey", "tova", 0.5, boom) is None  # skipped, not tried again
    assert calls == [1]  # on CPU: no retry with the torch kernels (they ran already)
    assert engine.errors == {("passkey", "tova", 0.5): "RuntimeError: no kernel"}
    assert engine.attempt("nll", "tova", 0.5, lambda: 7) == 7  # another task still runs it
    assert "tova at budget 0.5 failed on passkey, skipped there from here on: RuntimeError: no kernel" in (
        capsys.readouterr().err)
    engine.errors.clear()


def test_results_skip_done_rows_and_drop_a_cut_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    row = {"task": "passkey", "length": 96, "seed": 0, "method": "none", "budget": None, "score": 1.0}
    path.write_text(json.dumps(row) + "\n" + '{"task": "pass')
    results = Results(path)
    assert results.has(("passkey", 96, 0, "none", None))
    assert path.read_text() == json.dumps(row) + "\n"
    results.write([row, {**row, "seed": 1}])
    assert len(path.read_text().splitlines()) == 2


def test_bad_runs_are_refused(tokenizer):
    with pytest.raises(ValueError, match="cannot be as short as 100 tokens"):
        encode(tokenizer, "passkey", 100, 0)
    with pytest.raises(ValueError, match="method must be among"):
        LongRun(methods=("none", "h2o"))
    with pytest.raises(ValueError, match="one per length"):
        LongRun(lengths=(128, 256, 512), samples=(1, 2))
    with pytest.raises(ValueError, match="budgets"):
        LongRun(budgets=(0.0,))


def test_report_statistics_on_hand_made_rows():
    assert mean_se([1.0, 0.0, 1.0, 0.0]) == pytest.approx((0.5, (1 / 3) ** 0.5 / 2))
    rows = []
    for seed, (full, lossy) in enumerate([(1.0, 1.0), (1.0, 0.0), (0.0, 0.0), (1.0, 0.0)]):
        rows.append({"task": "passkey", "length": 96, "seed": seed, "method": FULL, "budget": None, "score": full,
                     "held_bytes": 100.0, "full_bytes": 100.0, "nll": None})
        rows.append({"task": "passkey", "length": 96, "seed": seed, "method": "snapkv", "budget": 0.5,
                     "score": lossy, "held_bytes": 48.0, "full_bytes": 100.0, "nll": None})
        rows.append({"task": "variable_tracking", "length": 96, "seed": seed, "method": FULL, "budget": None,
                     "score": 0.2, "held_bytes": 100.0, "full_bytes": 100.0, "nll": None})
    rows.append({"task": NLL, "length": 96, "seed": 0, "method": "snapkv", "budget": 0.5, "score": None,
                 "held_bytes": 50.0, "full_bytes": 100.0, "nll": 2.5})
    stats = summarise(rows)
    assert stats[("passkey", 96, "snapkv", 0.5)] == {"n": 4, "mean": 0.25, "se": 0.25, "held": 0.48}
    assert stats[(NLL, 96, "snapkv", 0.5)]["mean"] == 2.5
    kept, full = kept_tasks(stats)
    assert kept[96] == ["passkey"] and full[96]["variable_tracking"] == pytest.approx(0.2)
    text = markdown(rows)
    assert "Left out of the ranking (full-cache score below the bar): variable_tracking (0.20)" in text
    assert "| snapkv | 0.5 | 0.480 | 4 | 0.250 ± 0.250 | - | 0.250 ± 0.250 |" in text
    assert "| snapkv | 0.5 | 0.500 | 1 | 2.500 ± 0.000 |" in text
    # the goal's verdict per budget: the best summary method against the best method, paired over shared samples
    more = [dict(r, method="summary", score=1.0 - (r["seed"] == 2)) for r in rows if r["method"] == "snapkv"
            and r["task"] == "passkey"]
    more.append({"task": NLL, "length": 96, "seed": 0, "method": "summary", "budget": 0.5, "score": None,
                 "held_bytes": 50.0, "full_bytes": 100.0, "nll": 2.4})
    text = markdown(rows + more)
    assert "- kept mean, budget 0.5: summary 0.750, best summary 0.750: the summary is best" in text
    assert "- NLL at 96 tokens, budget 0.5: summary 2.400, best summary 2.400: the summary is best" in text
    # snapkv [1, 0, 0, 0] against the summary [0, 0, 0, 1]: a tie in mean and within its paired error
    tie = [dict(r, score=float(r["seed"] == 3)) for r in more if r["task"] == "passkey"]
    text = markdown(rows + tie)
    assert ("- kept mean, budget 0.5: summary 0.250, best snapkv 0.250: within one standard error of the best "
            "(snapkv; gap 0.000 ± 0.408, paired over 4 samples)") in text
    # every sample one better: the paired error is 0 however spread the samples are
    low = [dict(r, score=r["score"] - 1.0) for r in rows if r["method"] == "snapkv" and r["task"] == "passkey"]
    text = markdown(rows + [dict(r, method="summary") for r in low])
    assert "best snapkv 0.250: **snapkv wins by every sample** (gap 1.000 ± 0.000, paired over 4 samples)" in text


def test_cli_smoke_resumes_and_stops_on_time(tiny_assets, tmp_path, capsys):
    model_dir, text = tiny_assets
    out = tmp_path / "long"
    args = ["eval", "--suite", "long", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
            "--tasks", "passkey,variable_tracking", "--lengths", "200", "--samples", "2", "--methods",
            "none,summary,kvzip", "--budgets", "0.5", "--nll-lengths", "96", "--nll-samples", "1",
            "--continuation", "8", "--batch", "2", "--text", str(text), "--no-progress"]
    args, out = [*args, "--min-full-score", "0"], tmp_path / "long"
    args_out = [*args, "--out", str(out)]
    total = (2 * 2 + 1) * 3
    assert main([*args_out, "--max-seconds", "1e-6"]) == 0
    assert "stopped by --max-seconds" in capsys.readouterr().out
    cut = len((out / "results.jsonl").read_text().splitlines())
    assert cut == 2  # the first method of the first batch (2 samples), then the clock stops the run
    assert main(args_out) == 0
    printed = capsys.readouterr().out
    assert f"complete: {total - cut} rows" in printed
    assert "FAILED" not in printed and "shared prefill bit for bit a real one: summary True" in printed
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len({(r["task"], r["length"], r["seed"], r["method"], r["budget"]) for r in rows}) == len(rows) == total
    assert main(args_out) == 0
    assert "complete: 0 rows" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert "| method | budget | held | samples | passkey | variable_tracking | kept mean |" in report
    assert (out / "long_context.png").stat().st_size > 0
    assert main(["eval", "--suite", "long", "--out", str(out), "--report-only"]) == 0
    # the random model scores nothing: with the default bar the lossy methods skip every task (not the NLL rows)
    other = tmp_path / "bar"
    assert main([*args[:-2], "--out", str(other)]) == 0
    assert "lossy methods skipped: passkey@200, variable_tracking@200" in capsys.readouterr().out
    rows = [json.loads(line) for line in (other / "results.jsonl").read_text().splitlines()]
    assert {(r["task"], r["method"]) for r in rows if r["method"] != FULL} == {(NLL, "summary"), (NLL, "kvzip")}
    assert len(rows) == 2 * 2 + 3


class _Bar:
    def update(self, n: int) -> None:
        pass
