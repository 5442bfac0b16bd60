"""Shared helpers of the kvcache tests: a factory of `Request`s."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sits.core.request import Request
from sits.core.sampling_params import SamplingParams


@pytest.fixture
def make_request() -> Callable[..., Request]:
    """`make_request(request_id, prompt_token_ids, cache_salt=None, prompt_logprobs=None)`."""

    def make(
        request_id: str,
        prompt_token_ids: list[int],
        cache_salt: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> Request:
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs),
            eos_token_id=None,
            arrival_time=0.0,
            max_tokens=16,
            cache_salt=cache_salt,
        )

    return make
