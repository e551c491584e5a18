"""Makes the helper modules next to the sync tests importable (tests/ has no packages)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
