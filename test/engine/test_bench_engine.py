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
        assert float(row[2]) > 0 and float(row[3]) > 0 and float(row[4]) > 0
    assert "ratio for entries >= 1 MiB" in out
