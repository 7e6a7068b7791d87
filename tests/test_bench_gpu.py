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
    paged = text[text.index("### paged"):text.index("### tiers")]
    lines = [line for line in paged.splitlines() if line.startswith("| ") and "---" not in line]
    header, rows = lines[0], [r.strip("| ").split(" | ") for r in lines[1:]]
    assert "paged / contiguous" in header and "decode / copy" in header and "decode / SDPA" in header
    assert len(rows) == len(bench_gpu.PAGED_FORMATS) * 2 * 2   # formats x batches x contexts
    assert {r[0] for r in rows} == set(bench_gpu.PAGED_FORMATS)
    for r in rows:   # page size (K q4_1ch: whole groups), decode time, paged / contiguous, decode / copy
        assert r[3] == ("32" if r[0].startswith("q4_1ch") else "4")
        assert float(r[4]) > 0 and float(r[7]) > 0 and float(r[10]) > 0
    if gpu.using_emulator():
        assert "EMULATOR: times are CPU times" in paged
        assert all(r[11] == r[12] == "n/a" for r in rows)
    assert "### append" in text and "### tiers: prefix hit" in text and "### tiers: serving trace" in text
    assert bench_gpu.main(["--smoke", "attention"]) == 2     # no smoke size there


def test_bench_gpu_size_options(capsys):
    import bench_gpu
    assert bench_gpu.main(["--smoke", "paged", "--batches", "2", "--contexts", "7",
                           "--formats", "int8,q8_0", "--repeat", "1"]) == 0
    rows = [r.strip("| ").split(" | ") for r in capsys.readouterr().out.splitlines()
            if r.startswith("| ") and "---" not in r][1:]
    assert [(r[0], r[1], r[2]) for r in rows] == [("int8", "2", "7"), ("q8_0", "2", "7")]
    assert bench_gpu.main(["paged", "--formats", "f17"]) == 2
