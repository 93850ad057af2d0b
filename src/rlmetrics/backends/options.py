"""The options of :func:`~rlmetrics.connect` and the workers, by the layer that owns them: a misspelt
or misplaced option is refused at the call, naming its owner or the close match.

>>> check_options("connect('local')", "local", ["nan_stratgy"])
Traceback (most recent call last):
...
TypeError: connect('local'): no option 'nan_stratgy'; did you mean nan_strategy (a client option)?
>>> check_options("get_metric_worker()", "ray", ["nan_strategy"], ("aggregator", "Ray actor"))
... # doctest: +ELLIPSIS
Traceback (most recent call last):
...
TypeError: get_metric_worker(): no option 'nan_strategy'; it is a client option: give it to connect() ...
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Sequence

from rlmetrics.engine.aggregator import Aggregator


def _keywords(fn) -> tuple[str, ...]:
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds and n != "self")


CLIENT = ("nan_strategy", "label", "rank", "blocking", "naming")
AGGREGATOR = ("final_timeout", "step_timeout", *_keywords(Aggregator.__init__))

OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "local": {"client": CLIENT, "aggregator": AGGREGATOR},
    "ray": {
        "client": CLIENT,
        "aggregator": (*AGGREGATOR, "recovery_timeout", "secret"),
        "Ray actor": ("namespace", "num_cpus", "lifetime", "hierarchy"),
    },
    "torch": {
        "client": ("nan_strategy", "label", "rank", "naming"),
        "torch transport": ("group", "result_on", "renames", "keep_results", "device", "memory", "exchange"),
    },
}
"""Backend → layer → the options it takes (what :func:`~rlmetrics.connect` passes on)."""


def check_options(
    where: str, backend: str, given: Iterable[str], layers: Sequence[str] | None = None
) -> None:
    """TypeError for an option of ``given`` that no layer of ``layers`` (None: all) of ``backend``
    takes, naming ``where``, the option, and its owner or the close match."""
    mine = OPTIONS[backend]
    allowed = {o: layer for layer in (layers or mine) for o in mine[layer]}
    for option in given:
        if option in allowed:
            continue
        elsewhere = [layer for layer, opts in mine.items() if option in opts]
        other = [b for b, owned in OPTIONS.items() if any(option in opts for opts in owned.values())]
        close = difflib.get_close_matches(option, allowed, n=1)
        if elsewhere:
            hint = f"it is a {elsewhere[0]} option: give it to connect() or MetricClient(...)"
        elif other:
            hint = f"it is an option of connect({other[0]!r}), not of the {backend!r} backend"
        elif close:
            layer = allowed[close[0]]
            hint = f"did you mean {close[0]} ({'an' if layer[0] in 'aeiou' else 'a'} {layer} option)?"
        else:
            hint = "its options: " + "; ".join(f"{k}: {', '.join(mine[k])}" for k in (layers or mine))
        raise TypeError(f"{where}: no option {option!r}; {hint}")


__all__ = ["OPTIONS", "check_options"]
