"""`GrammarGate`: constrained requests wait here, out of the scheduler, while their grammar
compiles; each step lets in those whose compile is done.

When a request with `structured_outputs` reaches `EngineCore.add_request`, its grammar's
compile starts in the runner's grammar cache (`sampling.grammar.GrammarCache`, a thread pool),
or is found there compiled. A request whose grammar is ready goes to the scheduler at once;
the others are held here, and `admit` (at the start of each step) hands them to the
scheduler in arrival order as their compiles finish. So the step loop never waits for a
compile while it has other work: only an engine with nothing but held requests waits, a
little (`wait`, bounded), instead of spinning through empty steps. A compile that fails
(the server checked the spec already, so this is an internal failure) finishes its request
with finish reason "error" and xgrammar's message.

Invariants: a held request is not in the scheduler and holds no KV block; an abort of a held
request removes it here; requests leave in the order they came (samples 1..n-1 of an n > 1
request right after sample 0, whose prompt they wait for in the scheduler).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future

from sits.core.outputs import EngineCoreOutput
from sits.core.request import FinishReason, Request
from sits.sampling.grammar import GrammarCache, error_text

MAX_IDLE_WAIT_S = 0.05  # longest wait of an engine that has only held requests


class GrammarGate:
    """Requests held while their grammar compiles (see the module docstring).

    Args:
        cache: the runner's grammar cache, made on first use (`GrammarRows.cache`).
    """

    def __init__(self, cache: Callable[[], GrammarCache]) -> None:
        self._cache = cache
        self._held: dict[str, tuple[Request, Future]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def hold(self, request: Request) -> bool:
        """Start (or find) the request's compile; True when it is held (still compiling), False
        when it may go to the scheduler now (compiled, or no constraint). While others are
        held, a constrained request is held behind them (they keep their arrival order).

        Raises:
            InvalidParameterError: the engine has no tokenizer ("structured_outputs").
        """
        spec = request.sampling_params.structured_outputs
        if spec is None:
            return False
        future = self._cache().submit(spec)
        if future.done() and not self._held:
            return False
        self._held[request.request_id] = (request, future)
        return True

    def admit(self) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Take the held requests whose compile ended, in arrival order, up to the first still
        compiling.

        Returns:
            (requests for the scheduler, "error" outputs of those whose compile failed).
        """
        ready: list[Request] = []
        failed: list[EngineCoreOutput] = []
        for request_id, (request, future) in list(self._held.items()):
            if not future.done():
                break
            del self._held[request_id]
            exc = future.exception()
            if exc is None:
                ready.append(request)
            else:
                failed.append(_failed_output(request, exc))
        return ready, failed

    def wait(self, timeout_s: float = MAX_IDLE_WAIT_S) -> None:
        """Wait until the first held request's compile ends, at most `timeout_s`."""
        if self._held:
            first = next(iter(self._held.values()))[1]
            concurrent.futures.wait([first], timeout=timeout_s)

    def cancel(self, request_ids: list[str], reason: FinishReason) -> list[EngineCoreOutput]:
        """Drop held requests (abort, stop); their finished outputs. Unknown ids are ignored."""
        outputs = []
        for request_id in request_ids:
            entry = self._held.pop(request_id, None)
            if entry is not None:
                entry[0].finish_reason = reason
                outputs.append(EngineCoreOutput(request_id, finish_reason=reason))
        return outputs


def _failed_output(request: Request, exc: BaseException) -> EngineCoreOutput:
    request.finish_reason = FinishReason.ERROR
    return EngineCoreOutput(
        request.request_id,
        finish_reason=FinishReason.ERROR,
        error=f"the request's grammar did not compile: {error_text(exc)}",
    )
