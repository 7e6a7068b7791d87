"""tools/bench_gpu.py --smoke (issue 20, item 6): every smoke section runs end to end on
whatever --gpu selected (the emulator in CI) and prints its table with the peers' columns;
under the emulator the paged table says its times are not device figures and has no torch
SDPA column values (torch cannot run on the emulated device)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

pytestmark = pytest.mark.gpu


def test_bench_gpu_smoke_sizes_run(capsys):
    import bench_gpu
    from kvcore import gpu
    assert bench_gpu.main(["--smoke"]) == 0
    text = capsys.readouterr().out
    paged = text[text.index("### paged"):]
    lines = [line for line in paged.splitlines() if line.startswith("| ") and "---" not in line]
    header, rows = lines[0], [r.strip("| ").split(" | ") for r in lines[1:]]
    assert "decode / copy" in header and "decode / SDPA" in header
    assert len(rows) == 7 * 2 * 2                      # formats x batches x contexts
    assert {r[0] for r in rows} == set(bench_gpu.PAGED_FORMATS)
    for r in rows:
        assert float(r[3]) > 0 and float(r[7]) > 0     # decode time, decode / copy
    if gpu.using_emulator():
        assert "EMULATOR: times are CPU times" in paged
        assert all(r[8] == r[9] == "n/a" for r in rows)
    assert "### append" in text
    assert bench_gpu.main(["--smoke", "attention"]) == 2     # no smoke size there
