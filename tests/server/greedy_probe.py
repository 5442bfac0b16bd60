"""The engine's own greedy continuation of a prompt, for server tests that compare HTTP answers
with it (the server's shared engine, run on the live server's event loop)."""

from __future__ import annotations

from typing import Any

from sits.core.outputs import RequestOutput
from sits.core.sampling_params import RequestOutputKind, SamplingParams


async def greedy_token_ids(
    engine: Any, prompt_ids: list[int], max_tokens: int, request_id: str = "greedy-probe"
) -> list[int]:
    """The `max_tokens` greedy token ids (EOS ignored) the engine generates after `prompt_ids`."""
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    final: RequestOutput | None = None
    async for out in engine.generate(request_id, prompt_ids, params):
        final = out
    assert final is not None
    return list(final.outputs[0].token_ids)
