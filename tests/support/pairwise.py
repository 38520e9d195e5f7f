"""A small greedy all-pairs generator: cases covering every pair of values of every two options.

Each new case starts from the first pair (in declared order) still uncovered, then gives every other
option, in declared order, the value that covers the most uncovered pairs with the values chosen so
far (the first declared on a tie), never one that makes a forbidden pair with them. Deterministic,
and it never enumerates the product, so thirteen options cost a few milliseconds.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

Forbidden = Callable[[str, object, str, object], bool]


def _never(a: str, va: object, b: str, vb: object) -> bool:
    return False


def pairs_of(case: dict, names: list[str]) -> set[tuple]:
    """The pairs ((option, value), (option, value)) a case covers, options in declared order."""
    present = [n for n in names if n in case]
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(present, 2)}


def allowed_pairs(options: dict[str, tuple], forbidden: Forbidden = _never) -> set[tuple]:
    names = list(options)
    return {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
            for va in options[a] for vb in options[b] if not forbidden(a, va, b, vb)}


def all_pairs(options: dict[str, tuple], forbidden: Forbidden = _never) -> list[dict]:
    """Cases (option -> value, in declared order) covering every allowed pair, none holding a
    forbidden pair. Raises ValueError if the constraints leave a case no value for some option."""
    names = list(options)
    index = {(n, v): (i, options[n].index(v)) for i, n in enumerate(names) for v in options[n]}
    uncovered = allowed_pairs(options, forbidden)
    cases: list[dict] = []
    while uncovered:
        first = min(uncovered, key=lambda p: (index[p[0]], index[p[1]]))
        case = dict(first)
        for name in names:
            if name in case:
                continue
            candidates = [v for v in options[name]
                          if not any(forbidden(n, case[n], name, v) or forbidden(name, v, n, case[n]) for n in case)]
            if not candidates:
                raise ValueError(f"no value of {name} goes with {case}")

            def gain(value: object, name: str = name) -> int:
                return sum(((n, case[n]), (name, value)) in uncovered or ((name, value), (n, case[n])) in uncovered
                           for n in case)

            case[name] = max(candidates, key=gain)  # max keeps the first of equals
        case = {n: case[n] for n in names}
        cases.append(case)
        uncovered -= pairs_of(case, names)
    return cases
