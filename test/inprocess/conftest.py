"""In-process tests of the services and room state machines (rig.py builds them from parts)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402


@pytest.fixture
def rig():
    """A prefill service with one registered decode peer (PrefillRig's defaults); modules that need
    another set-up define their own `rig`."""
    from rig import PrefillRig

    with PrefillRig() as r:
        r.register()
        yield r
