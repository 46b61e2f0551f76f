"""The hf-kvcompress command line: clear messages and exit codes."""

from __future__ import annotations

import pytest

from hf_kvcompress.cli import main


@pytest.fixture
def no_slow_work(monkeypatch):
    """Any model load (from_pretrained) or default-model conversion fails the test: errors must come first."""
    from hf_kvcompress import models

    def slow(*args, **kwargs):
        raise AssertionError("slow work started before the error")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", slow)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", slow)
    monkeypatch.setattr(models, "default_model_dir", slow)


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_unknown_model_folder_exits_2_with_one_line(tmp_path, capsys, no_slow_work):
    code = main(["demo", "--model", str(tmp_path / "missing"), "--mode", "none", "--new-tokens", "2"])
    assert code == 2
    one_line_error(capsys, "no such folder")


def test_unknown_hub_id_offline_exits_2_with_one_line(capsys, monkeypatch, no_slow_work):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["demo", "--model", "nobody/no-such-model-xyz", "--new-tokens", "2"]) == 2
    one_line_error(capsys, "'nobody/no-such-model-xyz' is not in the hub's cache and HF_HUB_OFFLINE is set")


def test_unreachable_hub_is_one_request_and_one_line(capsys, monkeypatch, no_slow_work):
    """No network: one `model_info` call fails at once, instead of a minute of from_pretrained's retries."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def unreachable(repo_id, **kwargs):
        calls.append(repo_id)
        raise ConnectionError("[Errno -2] Name or service not known")  # what the hub's HTTP client raises, in kind

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    assert main(["demo", "--model", "nobody/no-such-model-xyz", "--new-tokens", "2"]) == 2
    assert calls == ["nobody/no-such-model-xyz"]
    one_line_error(capsys, "cannot reach the Hugging Face hub", "not in the hub's cache")


@pytest.mark.parametrize("dataset", ["/no/such/texts", "./missing.txt", "nothing-*.jsonl"])
def test_missing_dataset_path_fails_before_the_model_loads(tmp_path, capsys, monkeypatch, no_slow_work, dataset):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--dataset", dataset, "--new-tokens", "2"]) == 2
    one_line_error(capsys, f"dataset {dataset!r}: no such file or folder")


def test_unwritable_calibration_folder_fails_before_the_model_loads(tmp_path, capsys, no_slow_work):
    (tmp_path / "a-file").write_text("")
    assert main(["calibrate", "--out", str(tmp_path / "a-file" / "cal")]) == 2
    one_line_error(capsys, "cannot write to calibration folder")


def test_bad_subcommand_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


@pytest.mark.real_model
def test_demo_runs_on_the_default_model(capsys, monkeypatch):
    monkeypatch.setenv("HF_KVCOMPRESS_THREADS", "2")
    code = main(["demo", "--mode", "none", "--prompt-tokens", "64", "--new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "threads: 1 torch thread(s), 2 codec worker(s) (2 cores: HF_KVCOMPRESS_THREADS)" in out  # the plan it ran
    assert "identical_to_DynamicCache: True" in out
    assert "compression_ratio" in out


def test_version_names_the_library_and_what_it_runs_on(capsys):
    from hf_kvcompress import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hf-kvcompress {__version__} (transformers ") and "torch " in out


#: every command, and every bench's own parser: their --help must answer without torch (issue 47: 11-19 s each)
HELP_COMMANDS = [[], ["demo"], ["calibrate"], ["store"], ["eval"], ["bench"],
                 *(["bench", name] for name in ("generate", "codec", "prefix", "lmcache", "predictors", "kernels",
                                                "chunked"))]


def test_every_command_has_a_help_case():
    from hf_kvcompress.cli import COMMANDS
    from hf_kvcompress_eval.bench import BENCHES

    assert {c[0] for c in HELP_COMMANDS if c} == set(COMMANDS)
    assert {c[1] for c in HELP_COMMANDS if len(c) == 2} == set(BENCHES)


@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: " ".join(c) or "top")
def test_help_imports_neither_torch_nor_transformers(command):
    """Counts imports, not seconds: a fresh interpreter answers ``<command> --help`` with no heavy module loaded."""
    import subprocess
    import sys

    script = ("import sys\nfrom hf_kvcompress.cli import main\n"
              f"try:\n    main({[*command, '--help']!r})\nexcept SystemExit as done:\n    assert done.code == 0\n"
              "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'numba') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: hf-kvcompress" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-300:]


def usage_error(capsys, argv: list[str], *needles: str) -> str:
    """A usage error: exit status 2, no traceback, one line naming the option and where the options are."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err
    (line,) = err.splitlines()
    assert ": error: " in line and "--help)" in line
    for needle in needles:
        assert needle in line, err
    return line


@pytest.mark.parametrize(("argv", "needles"), [
    (["demo", "--new-tokens", "0"], ["argument --new-tokens: value must be >= 1, got 0"]),
    (["demo", "--prompt-tokens", "-5"], ["argument --prompt-tokens: value must be >= 1, got -5"]),
    (["demo", "--residual-tokens", "x"], ["argument --residual-tokens: expected an integer, got 'x'"]),
    (["calibrate", "--probe-layers", "abc"], ["argument --probe-layers: expected an integer, got 'abc'"]),
    (["calibrate", "--probe-layers", "8,0"], ["argument --probe-layers: value must be >= 1, got 0"]),
    (["calibrate", "--chunk", "8"], ["argument --chunk: value must be >= 16, got 8"]),
    (["calibrate", "--predictors", "context,oracle"], ["argument --predictors: expected comma-separated names"]),
    (["eval", "--threads", "-1"], ["argument --threads: value must be >= 0, got -1"]),
    (["eval", "--suite", "long", "--batch", "0"], ["argument --batch: value must be >= 1, got 0"]),
    (["bench", "generate", "--steps", "0"], ["argument --steps: value must be >= 1, got 0"]),
    (["bench", "chunked", "--budget", "2"], ["argument --budget: value must lie in (0.0, 1.0], got 2.0"]),
])
def test_bad_numbers_are_usage_errors_at_parse_time(capsys, no_slow_work, argv, needles):
    usage_error(capsys, argv, *needles)


@pytest.fixture
def tiny_loader(monkeypatch):
    """The CLI's model load gives the 2-layer tiny Llama (max_position_embeddings 512) and no tokenizer."""
    from helpers import tiny_model

    from hf_kvcompress import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (tiny_model("llama-gqa"), None))


def test_probe_layers_outside_the_model_are_refused(tmp_path, capsys, tiny_loader):
    """Calibration.fit keeps only layers 1..n-1: 99 on a 2-layer model used to fit nothing without a word."""
    code = main(["calibrate", "--predictors", "probe", "--probe-layers", "1,99", "--tokens", "64", "--chunk", "32",
                 "--out", str(tmp_path / "cal")])
    assert code == 2
    one_line_error(capsys, "--probe-layers [99]: this model's probe layers are 1..1 (it has 2 layers)")


@pytest.mark.parametrize(("argv", "needle"), [
    (["demo", "--prompt-tokens", "500", "--new-tokens", "48"],
     "--prompt-tokens 500 with --new-tokens 48 makes 548 positions, more than the model's max_position_embeddings (512)"),
    (["calibrate", "--chunk", "1024", "--tokens", "2048"],
     "--chunk 1024 makes 1024 positions, more than the model's max_position_embeddings (512)"),
])
def test_a_forward_longer_than_the_models_positions_is_refused(tmp_path, capsys, tiny_loader, argv, needle):
    assert main([*argv, "--mode", "none"] if argv[0] == "demo" else [*argv, "--out", str(tmp_path / "c")]) == 2
    one_line_error(capsys, needle)


@pytest.fixture
def tiny_demo(tmp_path, monkeypatch, capsys):
    """The demo on the tiny bf16 Llama with a character-level tokenizer (ids < 128) and a local text file:
    ``run(*extra)`` returns its exit status and output."""
    import string

    import torch
    from helpers import tiny_model
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from hf_kvcompress import models as model_loading

    vocab = {"[UNK]": 0, "<eos>": 1, "<pad>": 2}
    for ch in sorted(set(string.printable)):
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>",
                                        pad_token="<pad>")
    monkeypatch.setattr(model_loading, "load_model",
                        lambda *a, **k: (tiny_model("llama-gqa", torch.bfloat16), tokenizer))
    text = tmp_path / "text.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 4)

    def run(*extra: str) -> tuple[int, str]:
        code = main(["demo", "--dataset", str(text), "--prompt-tokens", "40", "--new-tokens", "6",
                     "--block-tokens", "8", "--residual-tokens", "4", "--calibration", "none", *extra])
        return code, capsys.readouterr().out

    return run


def test_demo_prints_prefill_and_decode_for_both_caches(tiny_demo):
    """Issue 47: the overall tok/s hid a slow decode step behind the prefill; both caches' prefill seconds and
    decode speed are printed, with the decode step's ratio, and --json has the same figures."""
    import json

    code, out = tiny_demo("--json")
    assert code == 0
    lines = out.splitlines()
    timing = json.loads(lines[-1])
    assert timing["decode_tokens"] == 5  # --new-tokens 6: the first token is the prefill's
    for prefix in ("", "DynamicCache_"):
        assert timing[f"{prefix}prefill_s"] > 0
        assert timing[f"{prefix}decode_tokens_per_s"] > 0 and timing[f"{prefix}decode_ms_per_token"] > 0
        assert f"{prefix}tokens_per_s" in timing  # kept: the whole run's
    assert timing["decode_step_ratio"] == pytest.approx(
        timing["decode_ms_per_token"] / timing["DynamicCache_decode_ms_per_token"], rel=0.01)
    assert timing["identical_to_DynamicCache"] is True
    compressed = next(x for x in lines if "CompressedCache (lossless): prefill " in x)
    reference = next(x for x in lines if "DynamicCache: prefill " in x)
    assert f"decode {timing['decode_ms_per_token']:.1f} ms/token" in compressed
    assert f"prefill {timing['DynamicCache_prefill_s']:.2f} s" in reference
    assert f"decode step ratio: {timing['decode_step_ratio']:.2f}x DynamicCache's" in out
    assert "the 5 tokens after it" in out


@pytest.mark.parametrize(("compiled", "converted"), [(0, True), (7, False)])
def test_demo_says_first_use_only_when_it_was(tiny_demo, monkeypatch, compiled, converted):
    """"first use" used to be printed on every run: now only when the warm-up compiled kernels (the counter,
    monkeypatched here: the decision, not numba) or the default model was converted in this run."""
    from hf_kvcompress import cli
    from hf_kvcompress import models as model_loading

    counts = iter([0, compiled, compiled, compiled])  # warm-up before / after, generation before / after
    monkeypatch.setattr(cli, "kernel_compiles", lambda: next(counts))
    monkeypatch.setattr(model_loading, "default_model_converted", lambda: converted)
    code, out = tiny_demo("--no-check")
    assert code == 0
    (warm,) = [x for x in out.splitlines() if x.startswith("warm-up: ")]
    if compiled:
        assert warm.endswith(" s (first use: 7 kernels compiled and cached)"), warm
    else:
        assert warm.endswith(" s"), warm
    assert ("first use: converted to safetensors" in out) is not converted
    assert "first use only" not in out and "DynamicCache: prefill" not in out  # --no-check: no reference row
