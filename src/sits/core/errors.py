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
