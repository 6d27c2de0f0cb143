"""How much of an eval set the model has already read: the share of the eval text's 50-character
shingles that occur verbatim in the training text.

A held-out split cut by position or by file still leaks when the corpus repeats itself (licence
texts read twice through symlinks, boilerplate headers, quoted code): a row then "generalises" by
recalling. The benchmark reports this share beside every eval loss and refuses claims over 2 %.
Only the eval's shingles are held in memory (a set of a few hundred thousand strings at most); the
training text is streamed past them once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SHINGLE = 50  # characters: long enough that a match is a copy, not a common phrase
LIMIT = 0.02  # the largest share a benchmark accepts for an eval set


def _normal(text: str) -> str:
    """Whitespace runs to one space, so re-wrapped copies of a paragraph still match."""
    return " ".join(text.split())


def shingles(text: str, size: int = SHINGLE) -> set[str]:
    """Every `size`-character substring of `text` (whitespace normalised)."""
    t = _normal(text)
    return {t[i : i + size] for i in range(max(len(t) - size + 1, 0))}


def overlap(eval_texts: Iterable[str], train_texts: Iterable[str], size: int = SHINGLE) -> float:
    """The share of the eval texts' shingles found in any training text (0.0 .. 1.0).

    Shingles never span two documents: each text is shingled on its own."""
    wanted: set[str] = set()
    for text in eval_texts:
        wanted |= shingles(text, size)
    if not wanted:
        raise ValueError(f"the eval texts hold no {size}-character shingle: too short to check")
    found: set[str] = set()
    for text in train_texts:
        t = _normal(text)
        for i in range(max(len(t) - size + 1, 0)):
            piece = t[i : i + size]
            if piece in wanted:
                found.add(piece)
        if len(found) == len(wanted):
            break
    return len(found) / len(wanted)


def overlap_each(texts: Sequence[str], others: Iterable[str], size: int = SHINGLE) -> list[float]:
    """For each of `texts`, the share of its shingles found in any of `others`: one pass over
    `others` for all of them (choosing held-out documents that do not repeat the rest)."""
    owner: dict[str, list[int]] = {}
    totals = []
    for i, text in enumerate(texts):
        own = shingles(text, size)
        totals.append(len(own))
        for piece in own:
            owner.setdefault(piece, []).append(i)
    found = [0] * len(texts)
    for text in others:
        t = _normal(text)
        for j in range(max(len(t) - size + 1, 0)):
            for i in owner.pop(t[j : j + size], ()):
                found[i] += 1
    return [f / n if n else 1.0 for f, n in zip(found, totals)]
