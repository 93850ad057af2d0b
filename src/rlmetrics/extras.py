"""Optional dependencies: imported where used, with an error that names the pip extra.

>>> require("json", "dev").__name__
'json'
>>> require("surely_not_installed_xyz", "ray")
Traceback (most recent call last):
...
rlmetrics.extras.MissingExtra: this feature needs 'surely_not_installed_xyz': pip install 'rlmetrics[ray]'
>>> EXTRA_OF["rich"], EXTRA_OF["mlflow"]
('console', 'trackers')
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA_OF = {
    "ray": "ray", "torch": "torch", "tensordict": "torch", "rich": "console", "tqdm": "console",
    "matplotlib": "plot", "tensorboard": "tensorboard", **dict.fromkeys(
        ("wandb", "mlflow", "swanlab", "trackio", "clearml", "prometheus_client"), "trackers"),
}  # fmt: skip
"""The top-level module of each optional dependency → the extra of ``pyproject.toml`` that installs it."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtra` telling which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(
            f"this feature needs {module!r}: pip install 'rlmetrics[{extra}]'", name=module
        ) from exc
