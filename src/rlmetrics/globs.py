"""Globs over metric names: the one dialect of the CLI's ``-m``, ``make_sinks(keys=, core=)``, the
health rules' ``patterns``/``ignore`` and ``register_reduction`` (docs/trackers.md, docs/health.md).

:func:`fnmatch.fnmatchcase` on the whole name: ``*`` any characters, ``/`` included (so ``**`` is
``*``); ``?`` one character; ``[seq]`` one of ``seq``; every other character literal (``.``, ``@``).

>>> names = ["critic/score/mean", "critic/score/max", "actor/entropy", "val-core/math/acc/mean@4"]
>>> matching(names, ["critic/*", "val-core/**/mean@?"])
['critic/score/mean', 'critic/score/max', 'val-core/math/acc/mean@4']
>>> unmatched(names, ["critic/*", "critc/*"]), nearby(names, "critc/*")
(['critc/*'], "'critic/*' (2 metrics)")
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Sequence


def glob_regex(glob: str) -> str:
    """The regular expression of ``glob`` (:func:`fnmatch.translate`).

    >>> bool(re.match(glob_regex("actor/*"), "actor/entropy/hist")), bool(re.match(glob_regex("a.b"), "axb"))
    (True, False)
    """
    return fnmatch.translate(glob)


def compile_globs(globs: Iterable[str]) -> re.Pattern:
    """One pattern for ``globs``, its ``fullmatch`` true for a name any of them matches (none: never)."""
    return re.compile("|".join(f"(?:{glob_regex(g)})" for g in globs) or "(?!)")


def matching(names: Iterable[str], globs: Sequence[str]) -> list[str]:
    """The names matching any of ``globs`` (every name without globs), in the order of ``names``."""
    if not globs:
        return list(names)
    match = compile_globs(globs).fullmatch
    return [n for n in names if match(n)]


def unmatched(names: Iterable[str], globs: Sequence[str]) -> list[str]:
    """The globs of ``globs`` that match none of ``names``, in order."""
    names = list(names)
    return [g for g in globs if not matching(names, [g])]


def nearby(names: Sequence[str], glob: str) -> str:
    """What a glob matching none of ``names`` may have meant: a wider glob that matches (with its
    count), else the closest name ('' when nothing is close).

    >>> names = ["critic/score/mean", "critic/score/max", "actor/entropy"]
    >>> nearby(names, "critic/score"), nearby(names, "entropy"), nearby(names, "actor/entropi")
    ("'critic/score/*' (2 metrics)", "'*entropy*' (1 metric)", "'actor/entropy'")
    """
    head = glob.rstrip("*/")
    wider = [glob.rstrip("/") + "/*", f"*{glob}*"]
    if head and head != glob.rstrip("/"):  # a typo before a trailing '/*': the closest name prefix
        depth = head.count("/") + 1
        prefixes = {"/".join(n.split("/")[:depth]) for n in names}
        wider += [p + glob[len(head) :] for p in difflib.get_close_matches(head, prefixes, n=1)]
    for candidate in wider:
        n = len(matching(names, [candidate]))
        if n:
            return f"{candidate!r} ({n} metric{'s' if n > 1 else ''})"
    return ", ".join(map(repr, difflib.get_close_matches(glob, names, n=1)))


def did_you_mean(names: Sequence[str], globs: Sequence[str]) -> str:
    """``"; did you mean ...?"`` for globs that match none of ``names`` ('' when nothing is close)."""
    hints = [h for h in (nearby(names, g) for g in globs) if h]
    return f"; did you mean {', '.join(hints)}?" if hints else ""


__all__ = ["compile_globs", "did_you_mean", "glob_regex", "matching", "nearby", "unmatched"]
