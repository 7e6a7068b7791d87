"""tools/bench_cpu.py --plot (issue 18, item 3): the attention and accuracy sections'
figures are written as PNGs, captioned with the command and the machine, from a real
(small) run of each section."""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

pytest.importorskip("matplotlib")


def test_plots_of_a_small_run(tmp_path, monkeypatch):
    import _benchlib
    import bench_accuracy
    import bench_attention
    import _plots
    from matplotlib.image import imread
    # small: K/V cycled past a 256 KiB "cache" (a few copies each), an 8 MiB copy probe
    monkeypatch.setattr(bench_attention, "_llc_bytes", lambda: 256 * 2**10)
    monkeypatch.setattr(bench_attention, "copy_bandwidth",
                        lambda nbytes: _benchlib.copy_bandwidth(8 * 2**20, repeat=3))
    results = {"attention": bench_attention.main(["--contexts", "128", "256", "--threads", "1"]),
               "accuracy": bench_accuracy.main(["--positions", "64", "--no-model"])}
    times = results["attention"]["times"]
    assert {n for per_n in times.values() for n in per_n} == {128, 256}
    assert ("kvcore int8", 1) in times and results["attention"]["copy_GBps"] > 0
    acc = results["accuracy"]
    assert acc["kvcore f32"]["round trip gauss"] == 0          # f32 stores the input itself
    assert 0 < acc["kvcore f16"]["round trip gauss"] < acc["kvcore int8"]["round trip gauss"]
    paths = _plots.write(results, str(tmp_path), "python tools/bench_cpu.py --plot x\nsome CPU")
    assert [os.path.basename(p) for p in paths] == ["attention_bandwidth.png", "accuracy.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        img = imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 400 and np.ptp(img) > 0   # not blank


def test_plot_refused_without_matplotlib_before_any_benchmark(tmp_path):
    """--plot without matplotlib stops at once with the install line (no benchmark runs)."""
    code = ("import sys; sys.modules['matplotlib'] = None; sys.argv[1:] = ['--only', "
            f"'attention', '--plot', {str(tmp_path)!r}]; sys.path.insert(0, 'tools'); "
            "import bench_cpu; bench_cpu.main()")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "--plot needs matplotlib" in r.stderr
    assert "Decode attention" not in r.stdout and not os.listdir(tmp_path)
