"""Every test module's file name is unique across test/: pytest imports them by basename (the
test directories are not packages), so a second `test_x.py` in another directory stops the whole
collection with "import file mismatch" (it did once, in CI)."""

from collections import defaultdict
from pathlib import Path

TEST_ROOT = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    seen = defaultdict(list)
    for path in TEST_ROOT.rglob("test_*.py"):
        if "__pycache__" not in path.parts:
            seen[path.name].append(str(path.relative_to(TEST_ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
