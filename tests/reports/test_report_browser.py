"""report.html renders in a real headless browser (Debian's chromium), plots included.

The page comes from a real run: collectives on 4 emulated devices and their replay on
an H100 model. Chromium takes a screenshot; numpy checks it is not blank (many colours,
mostly not white) and that the embedded plots were decoded (pixels of the plots' own
colours, which the page's CSS does not use).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

import reports
from mesh import Mesh
from vcluster.runtime.tracing import meta_like, trace_program
from vcluster.timing.engine import simulate_trace
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.presets import load_hardware

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT_TIMEOUT_S = 120.0
WINDOW = (1280, 2000)
COMM_RED = np.array([0xc4, 0x4e, 0x52]) / 255      # plots.py: collectives and exposed comm
COMPUTE_BLUE = np.array([0x4c, 0x72, 0xb0]) / 255  # plots.py: compute


def _program(dev, x):
    with dev.compute("matmul", flops=2 * x.shape[0] ** 3, bytes=3 * x.nbytes):
        y = x @ x
    total = dev.all_reduce(y, axis="tp")
    return dev.all_gather(total, axis="dp", dim=0).shape


@pytest.fixture(scope="module")
def report_dir(cluster_of, tmp_path_factory):
    mesh = Mesh((2, 2), ("dp", "tp"))
    args = [(np.full((32, 32), r, np.float32),) for r in range(mesh.size)]
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    cluster.run(_program, args)
    events = cluster.trace()
    result = simulate_trace(trace_program(mesh, _program, [(meta_like(a),) for (a,) in args]),
                            HardwareCostModel(load_hardware("h100-dgx")), mesh=mesh)
    record = reports.RunRecord(
        name="browser check", mode="both", scenario={}, hardware="h100-dgx",
        summary=result.summary(),
        checks=({"name": "all_gather", "passed": True, "max_abs_error": 0.0,
                 "tolerance": 0.0},),
        devices=pd.concat([reports.devices_from_events(events, mesh),
                           reports.devices_from_simulation(result, mesh)]),
        collectives=pd.concat([reports.collectives_from_events(events, mesh),
                               reports.collectives_from_simulation(result, mesh)]),
        spans=pd.concat([reports.spans_from_events(events),
                         reports.spans_from_simulation(result)]))
    return reports.write_report(record, tmp_path_factory.mktemp("browser") / "report",
                                formats=["html"])


def _screenshot(page, png, profile) -> None:
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install-test-deps.sh (it installs "
                    f"Debian's chromium, which this test needs)")
    command = [CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
               "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
               f"--screenshot={png}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
               page.as_uri()]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=SCREENSHOT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the test waited {SCREENSHOT_TIMEOUT_S:.0f} s for headless chromium to "
                    f"screenshot {page}; it never finished")
    assert proc.returncode == 0 and png.exists(), \
        f"chromium exited {proc.returncode} without a screenshot:\n{output.decode()[-2000:]}"


def _near(pixels, colour, tolerance=0.03) -> int:
    return int((np.abs(pixels[..., :3] - colour) < tolerance).all(axis=-1).sum())


def test_report_html_renders_in_headless_chromium(report_dir, tmp_path):
    png = tmp_path / "screenshot.png"
    _screenshot(report_dir / "report.html", png, tmp_path / "profile")
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    rgb = pixels[..., :3].reshape(-1, 3)
    white = (rgb > 0.98).all(axis=1).mean()
    colours = len(np.unique((rgb * 255).round().astype(np.uint8), axis=0))
    assert white < 0.9, f"the screenshot is {white:.1%} white"
    assert colours > 200, f"the screenshot has only {colours} distinct colours"
    assert _near(pixels, COMM_RED) > 2000, "no communication bars: the plots did not render"
    assert _near(pixels, COMPUTE_BLUE) > 500, "no compute bars: the plots did not render"
