"""In-process tests of the services and room state machines (rig.py builds them from parts)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
