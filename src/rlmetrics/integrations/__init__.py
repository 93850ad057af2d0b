"""Drop-in APIs of other RL frameworks, exact across ranks.

- :mod:`rlmetrics.integrations.verl`: verl 0.9.1's metric functions (``verl/trainer/ppo/metric_utils.py``,
  ``verl/utils/metric/utils.py``) with verl's names and signatures; verl is not needed to import it.
"""
