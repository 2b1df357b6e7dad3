"""`sglang-mori bench engine` runs end to end on small sizes and checks the bytes it moved."""

from __future__ import annotations

import argparse

import pytest

from sglang_mori.cli import bench_engine

SOFTIO_ONLY = True


@pytest.mark.timeout(180)
def test_bench_engine_prints_a_table_for_each_size(capsys):
    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    args = parser.parse_args(["--sizes", "4096,1048576", "--iters", "2", "--seconds", "0.2",
                              "--batch-bytes", "2097152", "--qp", "2"])
    assert bench_engine.run(args) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("4KiB", "1MiB"))]
    assert [r[0] for r in rows] == ["4KiB", "1MiB"]
    for row in rows:
        # entry, entries, then tcp, raw, intrahost, memcpy GB/s and the two ratios
        assert len(row) == 8 and all(float(v) > 0 for v in row[2:])
    assert "# softio-tcp engine uses tcp lanes" in out
    assert "# softio-intrahost engine uses intra-host lanes" in out
    assert "softio-tcp/raw ratio for entries >= 1 MiB" in out
    assert "softio-intrahost/memcpy ratio for entries >= 1 MiB" in out


@pytest.mark.timeout(180)
def test_bench_engine_measures_one_path_alone(capsys):
    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    args = parser.parse_args(["--sizes", "65536", "--iters", "2", "--seconds", "0.2",
                              "--paths", "intrahost"])
    assert bench_engine.run(args) == 0
    out = capsys.readouterr().out
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("64KiB")]
    assert len(row) == 5  # entry, entries, intrahost GB/s, memcpy GB/s, ratio
    assert "raw" not in out.split("\n")[1]
