"""The CPU kernels' other code paths: this machine builds the AVX-512 one
(``-march=native``), so the AVX2 and plain C++ paths that most laptops and
older servers would run are built here for those targets
(``STRATA_CPU_MARCH``) and the CPU kernel tests are run against each build.
About a minute per target, most of it the compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("march,simd", [("haswell", "avx2"), ("x86-64", "scalar")])
def test_the_kernel_tests_pass_for_an_older_target(march, simd):
    env = {**os.environ, "STRATA_CPU_MARCH": march}
    probe = subprocess.run(
        [sys.executable, "-c", "from strata_kernels import cpu_kernels as c; m = c.kernels(); "
                               "print(m.simd if m else c.build_error())"],
        env=env, capture_output=True, text=True, timeout=900)
    assert probe.stdout.strip() == simd, probe.stdout + probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
         str(HERE / "test_cpu_kernels.py"), str(HERE / "test_kv_kernels.py")],
        env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
