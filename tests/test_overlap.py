"""The eval-in-training overlap check (peer/bench/overlap.py)."""

from __future__ import annotations

import pytest

from peer.bench.overlap import overlap, overlap_each, shingles

TRAIN = "The quick brown fox jumps over the lazy dog while the cat watches from the fence."
FRESH = "An entirely different sentence about pipeline stages and compressed gradients on slow links."


def test_fresh_text_does_not_overlap() -> None:
    assert overlap([FRESH], [TRAIN]) == 0.0


def test_a_copy_overlaps_fully_whatever_its_line_breaks() -> None:
    rewrapped = TRAIN.replace(" the ", "\n  the ")
    assert overlap([rewrapped], [TRAIN]) == 1.0


def test_a_partly_copied_eval_text_overlaps_by_the_copied_shingles() -> None:
    mixed = TRAIN + " " + FRESH
    assert overlap([mixed], [TRAIN]) == pytest.approx((len(TRAIN) - 49) / (len(mixed) - 49))


def test_shingles_do_not_span_two_training_documents() -> None:
    # the eval text is the end of one document glued to the start of the next
    a, b = "x" * 30 + "alpha beta gamma delta", "epsilon zeta eta theta iota" + "y" * 30
    glued = "alpha beta gamma delta epsilon zeta eta theta iota"
    assert overlap([glued], [a, b]) == 0.0
    assert len(shingles(glued)) == len(glued) - 49


def test_an_eval_text_too_short_to_check_is_refused() -> None:
    with pytest.raises(ValueError, match="too short"):
        overlap(["short"], [TRAIN])


def test_each_text_gets_its_own_share_in_one_pass() -> None:
    got = overlap_each([TRAIN, FRESH, "x"], [TRAIN + " and more"])
    assert got == [1.0, 0.0, 1.0]  # a text with no shingle counts as fully found: never held out
