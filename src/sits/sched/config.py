"""`SchedulerConfig`: the immutable limits the scheduler enforces each step.

Invariants (checked at construction): every limit is >= 1 and the cache has at least one
usable block besides the reserved null block 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Scheduler limits (vLLM engine-argument names).

    Attributes:
        max_num_batched_tokens: token budget of one step, prefill chunks and decodes together.
        max_num_seqs: most requests running (holding KV blocks) at once.
        max_model_len: context limit in tokens (prompt + outputs).
        block_size: tokens per KV block.
        num_blocks: KV blocks in the cache, including the reserved null block 0.
        enable_prefix_caching: reuse cached KV blocks of identical prefixes.

    Raises:
        InvalidParameterError: a limit is < 1, or num_blocks < 2.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int
    block_size: int = 16
    num_blocks: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise InvalidParameterError(
                "num_blocks",
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks!r}; "
                "give the KV cache more memory",
            )

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can use (all but the null block)."""
        return self.num_blocks - 1

    @classmethod
    def from_engine_config(
        cls, config: EngineConfig, *, num_blocks: int, max_model_len: int
    ) -> SchedulerConfig:
        """Scheduler limits from the engine config plus what the runner measured.

        Args:
            config: the engine configuration (budget, max_num_seqs, block size, caching).
            num_blocks: KV blocks the runner allocated.
            max_model_len: the resolved context length (config value or the model's).
        """
        return cls(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
        )
