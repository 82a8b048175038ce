"""A layer split across two processes: gloo ranks on 127.0.0.1, started here.

Each test starts real processes (directly with the launcher's environment,
or through torchrun) and compares rank 0's output with one process, or
kills a rank with a real signal and times how rank 0 ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from live_server import free_port

HERE = Path(__file__).parent
CLI = [sys.executable, "-m", "strata_server.cli"]
COMMON = ["--threads", "1", "--conversation-cache-mib", "0"]
SPLIT = ["--layer-split", "9", *COMMON]


def rank_env(rank: int, port: int, world: int = 2) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def start_ranks(cmd: list[str], world: int = 2, **popen) -> list[subprocess.Popen]:
    """Rank 0 last in the list's order of start, first in the returned list."""
    port = free_port()
    procs = [subprocess.Popen(cmd, env=rank_env(r, port, world), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              **popen) for r in range(world)]
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout.decode(), stderr.decode()))
    return out


def drive(model_file, out: Path, devices: str = "cpu,cpu") -> dict:
    """What rank 0 of a two-rank split saw (tests/rank_driver.py)."""
    cmd = [sys.executable, str(HERE / "rank_driver.py"), str(model_file), str(out),
           str(HERE / "data" / "gemma-3-270m-q4_k_m.float32.json"), devices]
    results = finish(start_ranks(cmd), timeout=600)
    for rank, (code, _, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}: {stderr[-3000:]}"
    return torch.load(out)


@pytest.fixture(scope="module")
def driven(model_file, tmp_path_factory):
    return drive(model_file, tmp_path_factory.mktemp("ranks") / "result.pt")


def test_two_ranks_give_the_greedy_tokens_and_logits_of_one_process(driven, engine, reference_float32):
    assert driven["props"]["stages"] == [{"device": "cpu", "layers": [0, 8]}, {"device": "cpu", "layers": [9, 17]}]
    for case, tokens in zip(reference_float32["greedy"], driven["greedy"]):
        assert tokens == engine.generate(case["prompt_tokens"], max_tokens=16, temperature=0).tokens
    for case, logits in zip(reference_float32["teacher_forced"], driven["logits"]):
        one = engine.logits(case["tokens"])
        # Each rank runs one thread and this process two: float32 sums run in
        # another order (about 4e-4 at most on logits of magnitude ~30).
        assert torch.allclose(logits, one, atol=2e-3, rtol=0), float((logits - one).abs().max())
        assert torch.equal(logits.argmax(-1), one.argmax(-1))


def test_conversations_park_and_restore_across_ranks(driven, model_file):
    """Each rank's part of a snapshot goes into rank 0's pool and back; the
    restored runs equal cold runs of one process."""
    import strata_runtime

    conv = driven["conversation"]
    cold = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=512, conversation_cache_mib=0)
    assert conv["tokens"] == [cold.generate(p, max_tokens=4, temperature=0).tokens for p in conv["prompts"]]
    assert conv["stats"]["restored"] >= 1 and max(conv["cached"][2:]) > 20
    assert conv["stats"]["skipped_by_reason"] == {}


def test_a_fault_in_stage_1s_checkpoint_part_skips_the_checkpoint_and_serves(driven, model_file):
    import strata_runtime

    fault = driven["fault"]
    assert fault["fired"] >= 1
    assert fault["stats"]["skipped_by_reason"].get("checkpoint:out_of_memory") == fault["fired"]
    cold = strata_runtime.load(model_file, dtype="float32", progress=False, context_length=512, conversation_cache_mib=0)
    assert fault["tokens"] == cold.generate(fault["prompt"], max_tokens=4, temperature=0).tokens


@pytest.mark.parametrize("split", ["9", "auto"])
def test_torchrun_runs_the_cli_with_one_stage_per_rank(model_file, engine, split):
    """``auto``: each rank measures its own free memory; the ranks agree on one plan."""
    prompt = "The capital of France is"
    port = free_port()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "strata_server.cli", "-v", "generate", prompt, "--model", str(model_file),
         "--temperature", "0", "-n", "12", "--context-length", "256", *COMMON, "--layer-split", split],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = engine.generate(prompt, max_tokens=12, temperature=0).text
    assert run.stdout == prompt + expected + "\n"
    assert "rank 1: serving layers" in run.stderr and "-17 on cpu" in run.stderr


def _start_long_generation(model_file, extra: list[str] = ()) -> list[subprocess.Popen]:
    procs = start_ranks([*CLI, "generate", "Once upon a time", "--model", str(model_file), "--temperature", "0",
                         "-n", "1500", "--context-length", "2048", *SPLIT, *extra])
    # Rank 0 prints the prompt once loaded, then streams: wait for generated text.
    seen = b""
    deadline = time.monotonic() + 300
    while len(seen) < len("Once upon a time") + 8 and time.monotonic() < deadline:
        chunk = procs[0].stdout.read1(64)
        if not chunk:
            break
        seen += chunk
    assert len(seen) >= len("Once upon a time") + 8, finish(procs)[0][2][-3000:]
    return procs


def test_a_killed_rank_ends_rank_0_with_a_clear_error_at_once(model_file):
    procs = _start_long_generation(model_file)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    code, _, stderr = finish(procs[:1], timeout=60)[0]
    elapsed = time.monotonic() - t0
    assert code == 2
    assert "rank 1 (stage 1, layers 9-17 on cpu) is gone" in stderr and "restart the job" in stderr
    assert elapsed < 10, elapsed


def test_a_hung_rank_ends_rank_0_after_the_rank_timeout(model_file):
    procs = _start_long_generation(model_file, ["--rank-timeout", "3"])
    procs[1].send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        code, _, stderr = finish(procs[:1], timeout=60)[0]
    finally:
        procs[1].kill()
        procs[1].wait()
    elapsed = time.monotonic() - t0
    assert code == 2
    assert "rank 1 (stage 1, layers 9-17 on cpu) did not answer within 3 s" in stderr
    assert 2.5 < elapsed < 15, elapsed


def test_a_follower_stops_when_rank_0_dies(model_file):
    procs = _start_long_generation(model_file)
    procs[0].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    code, _, stderr = finish(procs[1:], timeout=60)[0]
    assert code == 1 and time.monotonic() - t0 < 10
    assert "rank 1: stopping: rank 0" in stderr and "is gone" in stderr


@pytest.mark.parametrize("args, message", [
    (["--devices", "cpu,cpu,cpu"], "3 devices were given but the job has 2 ranks"),
    (["--layer-split", "30"], "boundary 30 is out of range"),
])
def test_bad_splits_fail_on_every_rank_before_loading(model_file, args, message):
    procs = start_ranks([*CLI, "generate", "Hi", "--model", str(model_file), "--threads", "1", *args])
    for rank, (code, _, stderr) in enumerate(finish(procs, timeout=120)):
        assert code == 2, (rank, stderr[-2000:])
        assert message in stderr and "loading" not in stderr, (rank, stderr[-2000:])


def test_the_server_serves_through_ranks(model_file, engine):
    """``torchrun ... strata serve``: rank 0's engine process drives rank 1."""
    import openai

    http, master = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(master), "-m", "strata_server.cli", "serve", "--model", str(model_file),
         "--port", str(http), "--context-length", "256", *SPLIT],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 300
        while True:  # 503 until the engine (and through it rank 1) is loaded
            try:
                reply = client.completions.create(model="gemma-3-270m-q4_k_m", prompt="The capital of France is",
                                                  max_tokens=8, temperature=0)
                break
            except (openai.APIConnectionError, openai.InternalServerError):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
                time.sleep(1)
        assert reply.choices[0].text == engine.generate("The capital of France is", max_tokens=8, temperature=0).text

        # Issue 23: rank 1 killed. The next request that needs it fails with a 500
        # (not a 400, and not on every request after: the engine ends), /health
        # leaves 200, and as a restarted engine cannot rejoin the job, the server exits non-zero.
        import psutil

        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        assert ranks, "rank 1's process was not found"
        min(ranks, key=lambda p: p.create_time()).kill()
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="gemma-3-270m-q4_k_m", prompt="Hello", max_tokens=4, temperature=0)
        assert caught.value.code == "engine_crashed"
        assert proc.wait(timeout=60) != 0
        log = proc.stderr.read().decode()
        assert "the engine cannot go on after" in log and "rank 1" in log, log[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


@pytest.mark.gpu
def test_two_ranks_on_the_gpu_agree_with_the_cpu(model_file, engine, reference_float32, tmp_path):
    """Both ranks on cuda:0 (GGUF blocks through the Triton kernels); the
    hidden state and logits cross between the ranks through host memory."""
    driven = drive(model_file, tmp_path / "gpu.pt", devices="cuda:0,cuda:0")
    for case, logits in zip(reference_float32["teacher_forced"], driven["logits"]):
        cpu = engine.logits(case["tokens"])
        assert float((logits.argmax(-1) == cpu.argmax(-1)).float().mean()) >= 0.99
    assert driven["conversation"]["stats"]["restored"] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL will not pair two ranks on one)")
def test_two_ranks_on_two_gpus_hand_off_over_nccl(model_file, engine, reference_float32, tmp_path):
    driven = drive(model_file, tmp_path / "nccl.pt", devices="cuda:0,cuda:1")
    for case, logits in zip(reference_float32["teacher_forced"], driven["logits"]):
        cpu = engine.logits(case["tokens"])
        assert float((logits.argmax(-1) == cpu.argmax(-1)).float().mean()) >= 0.99
    assert driven["conversation"]["stats"]["restored"] >= 1


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_an_untied_head_across_ranks_gives_the_tokens_of_one_process(tmp_path, arch):
    """The last rank scores with the file's output matrix, not the token table
    (untied heads); a mixture-of-experts model's experts run on the rank that
    holds their layer."""
    from gguf import GGMLQuantizationType
    from tiny_models import Shape, write_tiny_model

    tiny = write_tiny_model(tmp_path / "untied.gguf", arch, Shape(hidden=64, layers=4, tied=False, experts=6), 7,
                            GGMLQuantizationType.Q8_0)
    args = ["generate", "The quick brown fox", "--model", str(tiny), "--temperature", "0", "-n", "8",
            "--context-length", "128", *COMMON]
    one = subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    (code, stdout, stderr), (follower, _, follower_err) = finish(start_ranks(CLI + args + ["--layer-split", "2"]))
    assert code == 0 and follower == 0, stderr[-2000:] + follower_err[-2000:]
    assert stdout == one.stdout


def test_a_hybrid_model_across_ranks_gives_the_tokens_of_one_process(tmp_path):
    """Qwen3-Next split over two ranks, recurrent layers on both: each rank
    keeps its layers' recurrent state, and the prompt and decode steps equal
    one process's."""
    from tiny_hybrid import HybridShape, write_hybrid_model

    tiny = write_hybrid_model(tmp_path / "hybrid.gguf", HybridShape(recurrent_list=(True, False, True, True)), 7)
    args = ["generate", "The quick brown fox", "--model", str(tiny), "--temperature", "0", "-n", "8",
            "--context-length", "128", *COMMON]
    one = subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip()  # something was generated to compare
    (code, stdout, stderr), (follower, _, follower_err) = finish(start_ranks(CLI + args + ["--layer-split", "2"]))
    assert code == 0 and follower == 0, stderr[-2000:] + follower_err[-2000:]
    assert stdout == one.stdout


def test_smollm2_across_two_ranks_gives_the_tokens_of_one_process(smollm2_file):
    """A real llama-architecture file (tied head, GQA 9/3, 30 layers) split over two ranks."""
    args = ["generate", "The three primary colors are", "--model", str(smollm2_file), "--temperature", "0",
            "-n", "16", "--context-length", "256", *COMMON]
    one = subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    assert len(one.stdout.strip()) > 10
    (code, stdout, stderr), (follower, _, follower_err) = finish(start_ranks(CLI + args + ["--layer-split", "15"]))
    assert code == 0 and follower == 0, stderr[-2000:] + follower_err[-2000:]
    assert stdout == one.stdout
