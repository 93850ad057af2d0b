"""The engine: one aggregator's merge of every rank's contributions, and the rules of every call on it:
``server`` (the call protocol every backend shares), ``aggregator`` (the merged state per step),
``columns`` and ``steps`` (names, a step's reduction), ``derived``, ``store``; no metric family, sink,
backend, Ray or torch (``tests/test_package.py``). docs/architecture.md, "The aggregator's rules".
"""
