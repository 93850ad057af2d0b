"""Optional dependencies: imported where used, with an error that names the pip extra.

>>> require("json", "dev").__name__
'json'
>>> require("surely_not_installed_xyz", "ray")
Traceback (most recent call last):
...
ImportError: this feature needs 'surely_not_installed_xyz': pip install 'rlmetrics[ray]'
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ImportError telling which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"this feature needs {module!r}: pip install 'rlmetrics[{extra}]'") from exc
