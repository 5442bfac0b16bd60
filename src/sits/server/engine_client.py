"""The engine front end the server programs against (`sits.engine.async_llm.AsyncLLM`).

Written as `typing.Protocol`s so the server never imports the engine's model code and tests can
hand it a small double for fault paths. The contract:
- `generate` raises `InvalidParameterError`/`PromptTooLongError` before yielding anything,
  then yields `RequestOutput`s per `params.output_kind` (the server always asks for DELTA);
- closing the generator or cancelling the task iterating it aborts the request and frees its
  KV blocks at once;
- `is_healthy()` is cheap and never blocks: False once the engine loop died or stopped stepping.
Optional, read with `getattr` so small doubles still work: the stats' per-tenant `tenants`
and `waiting` maps and prefill counters (`sits.engine.stats.EngineStats`), and
`set_borrowing_tiers(tiers)` (overload control); without them the QoS layer sees no tenant
usage and no queue. Likewise the MoE expert surface of /v1/admin (`expert_stats()`,
`freeze_expert`, `unfreeze_expert`, `restore_expert`, each async and returning an
`ExpertStats` or None) and `stats().experts`; without them the admin routes answer no layers.
Cost and timelines: `stats().busy_s` and `stats().tenant_busy_s` (GPU-seconds, 0 without them)
and `async prefill_chunks()` (the dashboard's prefill chunks; none without it). Health:
`stall_reason()` (cheap, never blocks: why the running step counts as stalled, or None;
/health answers 503 "engine_stalled" while it is set; never stalled without it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from sits.core.outputs import RequestOutput
from sits.core.sampling_params import SamplingParams


class ServerTokenizer(Protocol):
    """What the server needs of the tokenizer."""

    eos_token_id: int | None
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def decode_token(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...


class EngineStatsView(Protocol):
    """A snapshot of the engine's load (`AsyncLLM.stats()`)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int


class EngineClient(Protocol):
    """The async engine front end (see the module docstring for the contract)."""

    tokenizer: ServerTokenizer
    max_model_len: int
    model_name: str
    errored: bool
    dead_error: BaseException | None

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        tenant_id: str = "default",
        priority: int = 0,
        cache_salt: str | None = None,
        start_deadline_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStatsView: ...

    async def shutdown(self) -> None: ...
