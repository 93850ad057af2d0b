"""``python -m examples.grpo [options]`` from the repository's root: the GRPO demo ``make demo`` runs."""

from examples.grpo.demo import main

raise SystemExit(main())
