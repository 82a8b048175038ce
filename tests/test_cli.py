"""The ``strata`` command, run as a real child process."""

from __future__ import annotations

import re
import subprocess
import sys

PROMPT = "The capital of France is"


def strata(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata_server.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout,
    )


def test_generate_streams_the_greedy_continuation(model_file, engine):
    expected = engine.generate(PROMPT, max_tokens=8, temperature=0).text
    out = strata("generate", PROMPT, "--model", str(model_file), "--temperature", "0", "-n", "8", "--stats")
    assert out.returncode == 0, out.stderr
    assert out.stdout == PROMPT + expected + "\n"
    assert "generated 8 tokens" in out.stderr


def test_bad_sampling_value_is_one_line_before_loading(model_file):
    out = strata("generate", PROMPT, "--model", str(model_file), "--temperature", "-1", timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "strata: error: temperature must be at least 0, got -1.0"
    assert out.stdout == ""


def test_bad_model_path_is_one_line(tmp_path):
    out = strata("generate", "hi", "--model", str(tmp_path / "missing.gguf"), timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing.gguf does not exist" in lines[0]


def test_bad_argument_is_reported_by_argparse():
    out = strata("generate", "hi", "--threads", "zero", timeout=60)
    assert out.returncode == 2 and "expected a whole number" in out.stderr


def test_info_describes_the_model(model_file):
    out = strata("info", str(model_file), "--context", "8192", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in ("architecture:    gemma3", "context length:  32768", "layers:          18",
                     "4 query, 1 key/value", "Q8_0", "Q4_K", "context of 8192 tokens",
                     "f16 stored as float32 with --dtype float32 on cpu",
                     "f16     36864 bytes per token (1.000x f16), 288.0 MiB",
                     "int8     9504 bytes per token (0.258x f16)", "k8v4     7344 bytes per token (0.199x f16)"):
        assert expected in text, expected
    fast = strata("info", str(model_file), "--context", "8192").stdout  # the default path: bfloat16 storage
    for expected in ("f16 stored as bfloat16 with --dtype auto on cpu","f16     18432 bytes per token (1.000x f16), 144.0 MiB",
                     "int8     9504 bytes per token (0.516x f16)", "k8v4     7344 bytes per token (0.398x f16)"):
        assert expected in fast, expected
    # Per tensor type, what each path reads: the exact path dense copies, the default one the file's blocks.
    assert re.search(r"Q4_K\s+\d+ tensors\s+[\d.]+ MiB  dense float32 copy made at load \([\d.]+ MiB\)", text), text
    assert re.search(r"Q4_K\s+\d+ tensors\s+[\d.]+ MiB  GGUF blocks \(CPU kernels\)", fast), fast


def test_info_on_a_llama_file(smollm2_file):
    out = strata("info", str(smollm2_file))
    assert out.returncode == 0, out.stderr
    # 30 layers x 3 KV heads x 64 x (keys and values) x 2 bytes (bfloat16 storage on the default CPU path)
    assert "architecture:    llama" in out.stdout
    assert re.search(rf"f16\s+{30 * 3 * 64 * 2 * 2} bytes per token", out.stdout), out.stdout


def test_chat_reads_turns_from_stdin(model_file):
    out = strata("chat", "--model", str(model_file), "--temperature", "0", "-n", "8", stdin="Hello there\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() != ""
