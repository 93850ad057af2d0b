"""Drop-in APIs of other RL frameworks, exact across ranks: :mod:`rlmetrics.integrations.verl` (verl
0.9.1's metric functions, docs/verl.md) and :mod:`rlmetrics.integrations.parallel` (which rank of a
data-parallel group submits, for any framework)."""
