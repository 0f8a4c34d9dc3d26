# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (holds 40 GiB and reads the device)
"""``python -m bridge demo`` on a GPU: both runs, the figures printed, the PNG written.
(Run by scripts/gpu-test.)"""

from __future__ import annotations

import csv
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
REPO = pathlib.Path(__file__).resolve().parents[2]
GIB = 1 << 30


def demo(tmp_path: pathlib.Path, *args: str) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    png = tmp_path / "demo.png"
    env = {k: v for k, v in os.environ.items() if k != "BRIDGE_GPU_MEMORY_LIMIT"}
    r = subprocess.run(
        [sys.executable, "-m", "bridge", "demo", *args, "--out", str(png)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(r.stdout)
    print(r.stderr[-3000:])
    return r, png


def row(out: str, name: str) -> list[str]:
    """The two figures of a row of the side-by-side table."""
    line = next(ln for ln in out.splitlines() if ln.startswith(name))
    return re.findall(r"\d+\.\d GiB|out of memory|done|the run failed", line[len(name) :])


def gib(text: str) -> float:
    return float(text.split()[0])


def check_png_and_csv(png: pathlib.Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists()
    else:
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    with png.with_suffix(".csv").open() as fh:
        rows = list(csv.DictReader(fh))
    for mode in ("native", "bridge"):
        samples = [r for r in rows if r["mode"] == mode and not r["label"]]
        assert len(samples) >= 10, mode  # sampled while the run went on, not only at marks
        labels = [r["label"] for r in rows if r["mode"] == mode and r["label"]]
        assert labels[0] == "start" and labels[-1] in ("torch has it", "torch: out of memory")


def test_small_size_both_finish_and_the_figures_add_up(tmp_path):
    r, png = demo(tmp_path, "--size", "4")
    assert r.returncode == 0, r.stderr
    assert "CuPy holds 4.0 GiB and frees it, then torch asks for 4.0 GiB" in r.stdout
    assert row(r.stdout, "torch asks for 4.0 GiB") == ["done", "done"]
    native_held, bridge_held = (gib(x) for x in row(r.stdout, "CuPy held after its free"))
    assert native_held >= 4.0  # CuPy's pool keeps what CuPy freed
    assert bridge_held == 0.0  # on the bridge CuPy holds nothing once it freed
    native_end, bridge_end = (gib(x) for x in row(r.stdout, "GPU in use after its answer"))
    # native: CuPy's 4 GiB and torch's 4 GiB at once; the bridge: torch reused CuPy's 4 GiB
    assert native_end - bridge_end >= 3.5, (native_end, bridge_end)
    assert "native finishes at" in r.stdout and "the bridge finishes at" in r.stdout
    check_png_and_csv(png)


def test_default_size_native_runs_out_and_the_bridge_finishes(tmp_path):
    r, png = demo(tmp_path)
    assert r.returncode == 0, r.stderr
    size = gib(re.search(r"torch asks for (\d+\.\d GiB)", r.stdout).group(1))
    total = gib(re.search(r"on device 0 \((\d+\.\d GiB)\)", r.stdout).group(1))
    assert 0.55 * total <= size <= 0.65 * total
    assert row(r.stdout, f"torch asks for {size:.1f} GiB") == ["out of memory", "done"]
    native_end, bridge_end = (gib(x) for x in row(r.stdout, "GPU in use after its answer"))
    assert size <= native_end < total and size <= bridge_end < size + 0.1 * total
    assert re.search(r"native runs out at \d+\.\d GiB in use: torch could not get", r.stdout)
    assert re.search(r"the bridge finishes at \d+\.\d GiB in use: torch got its", r.stdout)
    check_png_and_csv(png)


def test_size_with_a_unit_as_everywhere(tmp_path):
    """`--size 40GiB` (issue 31): a size with a unit, as every size of the library; on a
    card of less than 48 GiB the same in MiB of a tenth of it."""
    total = _device_total_gib()
    arg, want = ("40GiB", 40.0) if total > 90 else (f"{int(total * 102.4)}MiB", None)
    r, png = demo(tmp_path, "--size", arg)
    assert r.returncode == 0, r.stderr
    size = gib(re.search(r"CuPy holds (\d+\.\d GiB) and frees it", r.stdout).group(1))
    if want is not None:
        assert size == want
    assert row(r.stdout, f"torch asks for {size:.1f} GiB")[1] == "done"  # the bridge run
    check_png_and_csv(png)


def _device_total_gib() -> float:
    pytest.importorskip("cupy")
    r = subprocess.run(
        [sys.executable, "-c", "import cupy; print(cupy.cuda.runtime.memGetInfo()[1])"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return int(r.stdout) / GIB
