"""`ServerSettings` (what the CLI decides) and `ServerContext` (what every handler uses).

One context per app: the engine, the settings, the lifecycle (admission, drain, health) and
the metrics. Handlers get it from `request.app.state.ctx`; nothing is global.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sits.server.engine_client import EngineClient, ServerTokenizer
from sits.server.errors import model_not_found
from sits.server.jobs import EnginePrompt, GenerationJob
from sits.server.lifecycle import ServerLifecycle
from sits.server.metrics import ServerMetrics


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Server options (flag names follow `vllm serve`).

    Attributes:
        served_model_name: the name clients pass as `model`; None = the engine's model name.
        api_key: when set, /v1, /tokenize and /detokenize need `Authorization: Bearer KEY`.
        model_root: the checkpoint directory, shown in /v1/models.
        random_weights: the weights are random (untrained demo): said in /v1/models.
        model_description: a plain sentence for /v1/models.
        shutdown_timeout_s: how long SIGTERM waits for in-flight requests.
        health_poll_s: how often the engine's health is checked.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    model_root: str | None = None
    random_weights: bool = False
    model_description: str | None = None
    shutdown_timeout_s: float = 30.0
    health_poll_s: float = 0.2


class ServerContext:
    """Everything a handler needs; one per app.

    Args:
        engine: the engine front end.
        settings: server options.
        lifecycle: admission, drain and health.
    """

    def __init__(
        self, engine: EngineClient, settings: ServerSettings, lifecycle: ServerLifecycle
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.lifecycle = lifecycle
        self.model_name = settings.served_model_name or engine.model_name
        self.metrics = ServerMetrics(engine, self.model_name)

    @property
    def tokenizer(self) -> ServerTokenizer:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        """Raise 404 unless `name` is None or the served model's name."""
        if name is not None and name != self.model_name:
            raise model_not_found(name)

    def new_job(
        self,
        prefix: str,
        prompts: list[EnginePrompt],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> GenerationJob:
        """A job for `prompts` with a fresh request id `prefix-<hex>` and metrics attached."""
        return GenerationJob(
            self.engine,
            f"{prefix}-{uuid.uuid4().hex}",
            prompts,
            priority=priority,
            cache_salt=cache_salt,
            make_observer=self.metrics.recorder,
        )
