"""On/off environment switches (``REDLINE_*``): ``1``, the default, or ``0``."""

import os


def env_switch(name: str) -> bool:
    """Whether switch ``name`` is on (unset counts as ``1``); a value other than ``0`` or ``1`` is refused with a
    ValueError naming the variable."""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
