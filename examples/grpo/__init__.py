"""The GRPO demo of ``make demo``: a tiny policy trained with GRPO on Ray ranks, metrics via rlmetrics.

``demo`` drives the run, ``trainer`` is one rank, ``grpo`` the model, task and loss (docs/demo.md).
"""
