"""``python -m rlmetrics`` runs the command line."""

from rlmetrics.cli import main

raise SystemExit(main())
