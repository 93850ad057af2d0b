"""The numpy core: what a rank's numbers become and how they merge, with no client, engine, backend
or metric family above it.

- :mod:`~rlmetrics.core.stat`: ``Stat`` (count, sum, squared deviations, min, max, a sketch where a
  name asks for a percentile), built from arrays and tensors in one host copy
  (:mod:`~rlmetrics.core.values`, :mod:`~rlmetrics.core.host`, :mod:`~rlmetrics.core.summary`);
- :mod:`~rlmetrics.core.sketch`, :mod:`~rlmetrics.core.histogram`: mergeable quantiles and histograms;
- :mod:`~rlmetrics.core.reduce`: the reduction registry (a name's suffix says how it reduces);
- :mod:`~rlmetrics.core.states`: the one state protocol (``merge``, ``to_array``, ``reduce``) and the
  lazy table of state kinds the families register;
- :mod:`~rlmetrics.core.packing`, :mod:`~rlmetrics.core.groups`: a contribution packed as one schema
  and float64 arrays; per-group names.
"""
