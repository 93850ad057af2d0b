"""Parity tests against the peer system, siiRL 0.2.0 (``make install-peers``).

Importing siiRL sets up loguru sinks and creates ``$SIIRL_LOG_DIRECTORY`` (default ``./siirl_logs``)
in the working directory; point it at a temporary directory before any test module imports siiRL
(Ray workers started later inherit the variable).
"""

import os
import tempfile

os.environ.setdefault(
    "SIIRL_LOG_DIRECTORY", os.path.join(tempfile.gettempdir(), "rlmetrics-peers-siirl-logs")
)
os.environ.setdefault("LOGURU_LEVEL", "WARNING")
