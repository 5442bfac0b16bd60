"""`ScheduledRequest.build`: the scheduler's fast constructor gives the constructor's object."""

from __future__ import annotations

import dataclasses

import pytest

from sits.core.plan import ScheduledRequest


def test_build_equals_the_constructor_field_by_field() -> None:
    outputs = [5, 6]
    built = ScheduledRequest.build("r1", [6], 9, [3, 4, 7], True, outputs)
    made = ScheduledRequest("r1", [6], 9, [3, 4, 7], True, outputs)
    assert built == made
    assert dataclasses.astuple(built) == ("r1", [6], 9, [3, 4, 7], True, [5, 6])
    assert built.num_tokens == 1
    assert built.output_token_ids is outputs  # shared, as the constructor keeps it


def test_built_request_stays_frozen() -> None:
    built = ScheduledRequest.build("r1", [1, 2], 0, [1], False, [])
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.sample = True  # type: ignore[misc]
    assert built.sample is False
