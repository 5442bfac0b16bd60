"""`GrammarRows`: the constrained requests' grammar matchers on one runner, the token masks
they put on their logits rows, and the tokens they accept.

Each step the runner calls `mask` on the [B, V] logits of the rows it samples, before the
sampler: for the constrained rows only, each matcher fills its row of a CPU bitmask
(xgrammar's `fill_next_token_bitmask`, 1 bit per token id) and `apply_token_bitmask_inplace`
sets the disallowed logits to -inf (on the CPU its C++ loop, on CUDA its kernel) through an
index list, so the other rows are not touched: their tokens are exactly what they are in a
batch without constrained rows. Penalties, min_p, top-k/top-p, temperature and the returned
logprobs then all see the masked logits (as in vLLM, whose runner applies the grammar bitmask
before its sampler). After sampling, `accept` advances each matcher by its row's token and
names the requests whose grammar ended (the matcher accepted a stop token, or refused the
token: then the output cannot go on): the scheduler finishes those with "stop", EOS or not
(`ignore_eos` does not outlive the grammar).

Invariants: a matcher has accepted exactly its request's output tokens before its mask is
filled: `mask` first accepts the tokens it has not seen (none, normally: `accept` took them)
and rolls back any it saw that the request no longer has, so a preempted and recomputed
request (its output tokens kept) continues from the right state, and so does a request whose
steps ran on another path. Matchers follow the request id, not the batch row; they are
dropped when the request finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr
from torch import Tensor

from sits.core.errors import InvalidParameterError
from sits.core.structured_outputs import StructuredOutputsParams
from sits.sampling.grammar import GrammarCache

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class MatcherState:
    """One constrained request's matcher and the number of its output tokens it accepted."""

    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0


class GrammarRows:
    """Grammar matchers by request id, and their masks on a batch's logits.

    Args:
        cache: the compiled grammars (`GrammarCache`), or a callable making it on first use
            (loading the tokenizer only when a constrained request comes).
    """

    def __init__(self, cache: GrammarCache | Callable[[], GrammarCache]) -> None:
        self._cache = cache if isinstance(cache, GrammarCache) else None
        self._make_cache = None if isinstance(cache, GrammarCache) else cache
        self._states: dict[str, MatcherState] = {}
        self._bitmask: Tensor | None = None  # [rows, ceil(V / 32)] int32, on the host

    @property
    def cache(self) -> GrammarCache:
        """The grammar cache (made on first use)."""
        if self._cache is None:
            assert self._make_cache is not None
            self._cache = self._make_cache()
        return self._cache

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Give a request a matcher at the grammar's start (waits for its compile, which the
        engine started when the request arrived: done by now on the engine's own runner).

        Raises:
            InvalidParameterError: the grammar does not compile.
        """
        compiled = self.cache.get(spec)
        self._states[request_id] = MatcherState(xgr.GrammarMatcher(compiled))

    def drop(self, request_id: str) -> None:
        """Forget a finished request's matcher (unknown ids are ignored)."""
        self._states.pop(request_id, None)

    def num_accepted(self, request_id: str) -> int:
        """Output tokens the request's matcher has accepted."""
        return self._states[request_id].num_accepted

    def mask(
        self, request_ids: Sequence[str], outputs: Sequence[list[int]], logits: Tensor
    ) -> None:
        """Set the logits the grammars disallow to -inf, in the constrained rows only.

        Args:
            request_ids: the B rows' requests.
            outputs: each row's output tokens so far (the matcher is brought level first).
            logits: [B, V] float32, changed in place.
        """
        states = self._states
        rows = [i for i, request_id in enumerate(request_ids) if request_id in states]
        if not rows:
            return
        bitmask = self._host_bitmask(len(request_ids), logits.shape[1])
        masked: list[int] = []
        for row in rows:
            state = states[request_ids[row]]
            _bring_level(state, request_ids[row], outputs[row])
            if state.matcher.is_terminated():
                continue  # ended: the scheduler finishes it with this step's token
            if state.matcher.fill_next_token_bitmask(bitmask, row):
                masked.append(row)
        if not masked:
            return
        if logits.device.type == "cuda":
            device_mask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        else:
            device_mask = bitmask
        xgr.apply_token_bitmask_inplace(
            logits, device_mask, vocab_size=logits.shape[1], indices=masked
        )

    def accept(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> set[str]:
        """Advance the constrained rows' matchers by their sampled tokens.

        Returns:
            The requests whose grammar ended with this token (a stop token accepted) or
            refused it (logged; no valid continuation exists).
        """
        states = self._states
        ended: set[str] = set()
        for request_id, token_id in zip(request_ids, token_ids):
            state = states.get(request_id)
            if state is None:
                continue
            if not _accept(state, request_id, token_id) or state.matcher.is_terminated():
                ended.add(request_id)
        return ended

    def _host_bitmask(self, num_rows: int, vocab_size: int) -> Tensor:
        """A [num_rows, ceil(V / 32)] int32 host bitmask, all allowed (reused across steps)."""
        bitmask = self._bitmask
        width = -(-vocab_size // 32)
        if bitmask is None or bitmask.shape[0] < num_rows or bitmask.shape[1] != width:
            bitmask = self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), vocab_size)
        view = bitmask[:num_rows]
        xgr.reset_token_bitmask(view)
        return view


def _accept(state: MatcherState, request_id: str, token_id: int) -> bool:
    """Accept one token; False (logged) when the matcher refuses it."""
    if state.matcher.is_terminated() or not state.matcher.accept_token(token_id):
        logger.warning(
            "request %s: token %d is outside its grammar after %d tokens; it stops here",
            request_id,
            token_id,
            state.num_accepted,
        )
        return False
    state.num_accepted += 1
    return True


def _bring_level(state: MatcherState, request_id: str, output_token_ids: list[int]) -> None:
    """Make the matcher have accepted exactly `output_token_ids` (module invariants)."""
    num_outputs = len(output_token_ids)
    if num_outputs < state.num_accepted:
        state.matcher.rollback(state.num_accepted - num_outputs)
        state.num_accepted = num_outputs
    for token_id in output_token_ids[state.num_accepted :]:
        if not _accept(state, request_id, token_id):
            return


def grammar_cache_factory(
    tokenizer: str,
    resolve: Callable[[str], str],
    vocab_size: int,
    stop_token_ids: Sequence[int],
) -> Callable[[], GrammarCache]:
    """A factory of the grammar cache of a tokenizer, loaded when called (no remote code).

    Args:
        tokenizer: the tokenizer's directory or Hub id (loaded even when the engine skips
            its tokenizer, as an engine process does: the masks need the vocabulary).
        resolve: turns it into a local directory (`models.loader.resolve_model_path`).
        vocab_size: the model's logits width.
        stop_token_ids: the model's EOS ids.

    Raises (when called):
        InvalidParameterError: no tokenizer loads ("structured_outputs").
    """

    def make() -> GrammarCache:
        from transformers import AutoTokenizer

        try:
            tokenizer_dir = resolve(tokenizer)
            hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
        except (OSError, ValueError) as exc:  # ModelNotFoundError is an OSError
            raise InvalidParameterError(
                "structured_outputs", f"no tokenizer loads from {tokenizer!r}: {exc}"
            ) from exc
        return GrammarCache(hf_tokenizer, vocab_size, stop_token_ids)

    return make
