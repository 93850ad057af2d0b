"""Drop-in APIs of other RL frameworks, exact across ranks.

- :mod:`rlmetrics.integrations.verl`: verl 0.9.1's metric functions (``verl/trainer/ppo/metric_utils.py``,
  ``verl/utils/metric/utils.py``) with verl's names and signatures; verl is not needed to import it.
- :mod:`rlmetrics.integrations.parallel`: ``submitter``, which rank of a data-parallel group submits
  under tensor, sequence, context and pipeline parallelism, and with which ``world_size`` (any framework).
"""
