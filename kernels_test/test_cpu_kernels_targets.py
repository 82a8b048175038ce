"""The CPU kernels' other ISA variants: the best one this CPU runs serves
the rest of the suite, so the AVX-512 build without VNNI (Skylake-X), the
AVX2 build (most laptops and older servers) and the plain C++ one (any CPU)
are built here too, where this CPU runs them, and the tests of the CPU
kernels (marked ``cpu_kernels``) run against each, chosen with
``STRATA_CPU_ISA`` as a user would (their Triton comparisons, the same on
every variant, are left out there). The AVX2
run also repeats the default path's accuracy tests, since there ``auto``
takes float32 activations. About two minutes per variant the first time,
most of it the compile (then torch's cache)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata_kernels import cpu_kernels

HERE = Path(__file__).resolve().parent
KERNEL_TESTS = [str(HERE / "test_cpu_kernels.py"), str(HERE / "test_kv_kernels.py"), str(HERE / "test_experts.py")]


@pytest.mark.parametrize("isa,simd,extra", [
    ("avx512", "avx512", []),
    ("avx2", "avx2", [str(HERE.parent / "tests" / "test_fast_path.py")]),
    ("generic", "scalar", []),
])
def test_the_kernel_tests_pass_for_another_isa(isa, simd, extra):
    if isa == cpu_kernels.isa():
        pytest.skip(f"{isa} is this CPU's best variant: the rest of the suite runs it")
    if isa not in cpu_kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} variant (it runs {', '.join(cpu_kernels.supported_isas())})")
    env = {**os.environ, "STRATA_CPU_ISA": isa, "STRATA_RERUN_CPU_KERNELS_ONLY": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", "from strata_kernels import cpu_kernels as c; m = c.kernels(); "
                               "print(m.simd if m else c.build_error())"],
        env=env, capture_output=True, text=True, timeout=900)
    assert probe.stdout.strip() == simd, probe.stdout + probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "cpu_kernels and not gpu",
         *KERNEL_TESTS, *extra],
        env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=1800)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_an_isa_this_cpu_lacks_is_refused_with_the_ones_it_has():
    env = {**os.environ, "STRATA_CPU_ISA": "avx9"}
    probe = subprocess.run([sys.executable, "-c", "from strata_kernels import cpu_kernels as c; c.isa()"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode != 0 and "choose one of avx512vnni, avx512, avx2, generic" in probe.stderr


def test_torchs_own_avx2_switch_caps_the_variant_too():
    """``ATEN_CPU_CAPABILITY=avx2`` (what torch reads) gives the avx2 build,
    so one setting shows what an AVX2-only machine sees."""
    if "avx2" not in cpu_kernels.supported_isas():
        pytest.skip("this CPU has no AVX2")
    env = {k: v for k, v in os.environ.items() if k != "STRATA_CPU_ISA"}
    env["ATEN_CPU_CAPABILITY"] = "avx2"
    probe = subprocess.run([sys.executable, "-c", "from strata_kernels import cpu_kernels as c; print(c.isa())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "avx2", probe.stderr


def test_a_slow_build_shows_a_progress_line(capsys):
    """The first build on a machine takes about a minute: it says so while it
    runs (a cached build loads in well under the second before the line)."""
    import time

    with cpu_kernels._progress_line("building the CPU kernels (test)"):
        time.sleep(2.5)
    err = capsys.readouterr().err
    assert "building the CPU kernels (test)" in err and "00:0" in err
    with cpu_kernels._progress_line("quick"):
        pass
    assert "quick" not in capsys.readouterr().err


@pytest.mark.parametrize("env", [{"ATEN_CPU_CAPABILITY": "avx2"}, {"STRATA_CPU_ISA": "avx2"},
                                 {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}], ids=lambda e: "=".join(*e.items()))
def test_bfloat16_prefill_matmuls_only_where_torch_has_bf16_hardware(env):
    """The default path's prefill GEMMs go to bfloat16 only where torch runs
    them on bf16 dot products: never below the avx512 variant or with oneDNN
    capped under its bf16 ISA (the emulated AVX2 setting sets both)."""
    if "avx2" not in cpu_kernels.supported_isas():
        pytest.skip("this CPU has no AVX2")
    code = ("from strata_kernels import cpu_kernels as c; from strata_runtime.files import resolve; "
            "p = resolve('auto', 'cpu'); print(c.bf16_matmul(), p.prefill_matmuls)")
    clean = {k: v for k, v in os.environ.items() if k not in ("STRATA_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                                              "ONEDNN_MAX_CPU_ISA")}
    native = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=900)
    has = bool({"avx512_bf16", "amx_bf16"} & cpu_kernels.cpu_flags()) and "avx512" in cpu_kernels.supported_isas()
    assert native.stdout.split() == [str(has), "torch.bfloat16" if has else "torch.float32"], native.stderr
    capped = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                            timeout=900)
    assert capped.stdout.split() == ["False", "torch.float32"], capped.stderr


def test_a_kernel_cache_shared_between_cpus_never_hands_one_a_build_it_cannot_run(monkeypatch):
    """Issue 23, item 10: a torch extensions cache shared between machines
    (an NFS home, a prebuilt image) must not give a CPU without AVX-512 the
    AVX-512 build (SIGILL, then a crash loop). Each variant is compiled for
    a fixed target (never -march=native) under a name of its own, and a CPU
    runs the best variant whose required flags it has."""
    for name, (flags, needs) in cpu_kernels.ISA_VARIANTS.items():
        assert not any("native" in f for f in flags), name
    built = cpu_kernels.kernels()
    assert built is not None and built.__name__ == f"strata_cpu_kernels_{cpu_kernels.isa()}"
    base = {"sse4_2", "avx", "avx2", "fma", "f16c"}
    avx512 = base | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
    machines = {"avx512vnni": avx512 | {"avx512_vnni"}, "avx512": avx512, "avx2": base, "generic": {"sse4_2"}}
    monkeypatch.delenv("STRATA_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    for expected, flags in machines.items():
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=frozenset(flags): flags)
        chosen = cpu_kernels.isa.__wrapped__()
        assert chosen == expected and cpu_kernels.ISA_VARIANTS[chosen][1] <= flags


def test_a_build_killed_midway_does_not_block_every_later_load():
    """torch's build lock is a file: a build killed midway (Ctrl-C, the
    OOM killer, a CI job cut off) leaves it, and every later process that
    loads the extension, cached or not, waited for it forever (a CI run hung
    in collection this way). A Strata process holds an flock around the
    load, so a lock file it finds is stale: it is removed and the load goes on."""
    from torch.utils.cpp_extension import _get_build_directory

    assert cpu_kernels.kernels() is not None, cpu_kernels.build_error()
    stale = Path(_get_build_directory(f"strata_cpu_kernels_{cpu_kernels.isa()}", verbose=False)) / "lock"
    stale.touch()
    try:
        probe = subprocess.run([sys.executable, "-c", "from strata_kernels import cpu_kernels as c; "
                                "print(c.kernels() is not None)"],
                               capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("a load with a stale torch lock file in the build directory waited for it")
    finally:
        locked = stale.exists()
        stale.unlink(missing_ok=True)
    assert probe.stdout.strip() == "True", probe.stderr
    assert not locked and "left by a build that was interrupted" in probe.stderr, probe.stderr
