"""Named exceptions for user and configuration errors.

Every error a user can cause is one of these; the server turns them into OpenAI error bodies
(HTTP 400/404/...) and the offline API raises them as they are. `assert` stays for internal
invariants only.
"""

from __future__ import annotations


class SitsError(Exception):
    """Base class of every sits error meant for a user."""


class InvalidParameterError(SitsError, ValueError):
    """A request or sampling parameter has an invalid value.

    Attributes:
        param: the parameter's name as the user spelled it (OpenAI `param` field).
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidParameterError):
    """A request can never fit: prompt + max_tokens exceeds the context or the KV cache."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(param, message)


class UnsupportedModelError(SitsError, ValueError):
    """The checkpoint's architecture or an option in its config is not supported."""


class ModelNotFoundError(SitsError, FileNotFoundError):
    """A model path or Hugging Face id could not be resolved to a checkpoint directory."""


class EngineDeadError(SitsError, RuntimeError):
    """The engine loop has died; no request can be served until the process restarts."""


class TensorParallelWorkerError(EngineDeadError):
    """A tensor-parallel worker process died, failed, or hung past the collective timeout
    (`EngineConfig.tensor_parallel_timeout_s`): the engine cannot run another step."""


class PrecisionSwitchMemoryError(InvalidParameterError):
    """The two weight sets of `EngineConfig.precision_switch` and a minimal KV cache do not fit
    the device memory budget.

    Attributes:
        full_bytes: bytes of the model-dtype weights.
        twin_bytes: bytes the low-precision twin's own (quantized) weights need.
        min_kv_bytes: bytes of the smallest KV cache the engine starts with (one sequence of
            max_model_len tokens, and the null block).
        budget_bytes: memory left for the twin and the KV cache once the full model is loaded.
    """

    def __init__(
        self, scheme: str, full_bytes: int, twin_bytes: int, min_kv_bytes: int, budget_bytes: int
    ) -> None:
        super().__init__(
            "precision_switch",
            f"precision_switch {scheme!r} needs {twin_bytes} bytes for the {scheme} weights "
            f"beside the {full_bytes} bytes of the model-dtype weights, plus {min_kv_bytes} "
            f"bytes for a minimal KV cache, but only {budget_bytes} bytes are left after the "
            "model-dtype weights (raise gpu_memory_utilization, lower max_model_len, or drop "
            "the switch)",
        )
        self.full_bytes = full_bytes
        self.twin_bytes = twin_bytes
        self.min_kv_bytes = min_kv_bytes
        self.budget_bytes = budget_bytes
