"""The continual-pretraining prose corpus (peer/bench/prose.py): code out, markup reduced to its
text, each paragraph once across the corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from peer.bench import prose
from peer.errors import ConfigError

PAGE = """\
.. _tut-for:

:keyword:`!for` Statements
==========================

.. index::
   statement: for

The :keyword:`for` statement differs a bit, see :ref:`the tutorial <tut-intro>`
and :func:`~os.path.join`.  For example::

   for w in words:
       print(w)

::

   >>> print("doctest after a bare ::")

>>> x = 1
>>> x
1

.. code-block:: python

   def f(): pass

.. note::

   Notes are prose and stay.

:param x: a field list line goes.
An ``if`` ... ``elif`` sentence keeps its dots.
"""


def test_code_goes_and_prose_stays() -> None:
    got = prose.prose_of(PAGE)
    assert got == [
        "for Statements",
        "The for statement differs a bit, see the tutorial and join. For example:",
        "Notes are prose and stay.",
        "An if ... elif sentence keeps its dots.",
    ]


def test_a_sentence_is_written_once_across_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = "A sentence long enough to hold a fifty-character shingle of its own."
    src = tmp_path / "_sources"
    (src / "a").mkdir(parents=True)
    (src / "a" / "one.rst.txt").write_text(f"{shared}\n\nOnly in one.\n")
    (src / "two.rst.txt").write_text(f"{shared}\n\nOnly in two. {shared} Short ones repeat.\n")
    monkeypatch.setattr(prose, "MIN_BYTES", 10)
    counts = prose.write_corpus(src, tmp_path / "out")
    assert counts == {"pages": 2, "paragraphs": 3, "duplicates": 1, "bytes": counts["bytes"]}
    assert (tmp_path / "out" / "a" / "one.txt").read_text() == f"{shared}\n\nOnly in one.\n"
    assert (tmp_path / "out" / "two.txt").read_text() == "Only in two. Short ones repeat.\n"


def test_too_little_prose_is_refused_with_the_minimum(tmp_path: Path) -> None:
    (tmp_path / "p.rst.txt").write_text("Just a line.\n")
    with pytest.raises(ConfigError, match="5,000,000"):
        prose.write_corpus(tmp_path, tmp_path / "out")
