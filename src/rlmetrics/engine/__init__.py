"""The engine: one aggregator's merge of every rank's contributions, and the rules of every call on it.

- :mod:`~rlmetrics.engine.server`: the call protocol (``Server.handle``: merge, finalize, save,
  reply), recovery, sessions, relays, deadlines; shared by every backend;
- :mod:`~rlmetrics.engine.aggregator`: the merged state per ``(step, name)`` and when a step is final;
- :mod:`~rlmetrics.engine.columns`, :mod:`~rlmetrics.engine.steps`: the name registry, a step's
  pending state and its reduction;
- :mod:`~rlmetrics.engine.derived`: derived metrics as a declared table (a hook the families extend);
- :mod:`~rlmetrics.engine.wire`: the Ray wire format (names once per schema, then float64 buffers).

It imports no metric family, sink, backend, Ray or torch (``tests/test_package.py``).
"""
