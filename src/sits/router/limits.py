"""Tenants at the router: authentication and one rate-limit budget for the whole fleet.

With `--tenants`, the router maps a client's bearer key to its tenant (401 otherwise) and admits
the request against the tenant's `requests_per_minute`, `tokens_per_minute` and
`max_concurrent` through the same `AdmissionController` as `sits serve`, so a tenant's budget is
spent once however many replicas serve it; a refusal is the same 429 (Retry-After,
retry-after-ms, x-ratelimit-*), built by `sits.server.qos.admit.rejection_error`.

The router does not tokenize. A request reserves an estimate of its prompt tokens
(`estimate_prompt_tokens`: token ids counted exactly, text at `BYTES_PER_TOKEN` UTF-8 bytes per
token, the usual ratio of byte-level BPE vocabularies on English and code) plus its
`max_tokens` (times `n`); when the answer ends, the reservation is reconciled with the replica's
`usage.total_tokens` (streams are asked for their usage chunk, which the router removes when the
client did not ask for it). Limits that no wait lifts (max_prompt_tokens,
max_tokens_per_request, a request larger than a minute's tokens) are left to the replica, which
counts exactly: the reservation is clamped to them, so the router never answers 400 on an
estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sits.admission import AdmissionController, AdmissionTicket, Clock
from sits.server.errors import ServerError
from sits.server.qos.admit import rejection_error
from sits.tenancy import TenantConfig, TenantsConfig

BYTES_PER_TOKEN = 4
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Prompt tokens of a completions or chat body: ids counted, text estimated.

    Args:
        body: the parsed JSON request (`prompt` or `messages`).

    Returns:
        An estimate in tokens, >= 0 (text: ceil(UTF-8 bytes / BYTES_PER_TOKEN)).
    """
    if "messages" in body:
        return _text_tokens(_messages_text(body.get("messages")))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return len(prompt)
        total = 0
        for part in prompt:
            if isinstance(part, str):
                total += _text_tokens(part)
            elif isinstance(part, list):
                total += len(part)
        return total
    return 0


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text a request's prefix key hashes: a completion's prompt, a chat's messages."""
    if "messages" in body:
        return _messages_text(body.get("messages"))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return " ".join(str(t) for t in prompt)
        if isinstance(first, list):
            return " ".join(str(t) for t in first)
    return ""


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts: the text ones
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("text")
            )
        parts.append(f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}")
    return "\n".join(parts)


def _text_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "replace")) / BYTES_PER_TOKEN)


def requested_max_tokens(body: Mapping[str, Any], context_left_tokens: int) -> int:
    """The most tokens a request may generate, all samples together.

    Args:
        body: the parsed request.
        context_left_tokens: what the context leaves after the prompt (a chat without
            max_tokens may run to the end of it), tokens, >= 0.
    """
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        value = COMPLETION_DEFAULT_MAX_TOKENS if "prompt" in body else context_left_tokens
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    return value * n


@dataclass(frozen=True, slots=True)
class FleetTicket:
    """One request admitted at the router.

    Attributes:
        tenant: its tenant.
        admission: the admission ticket to release with the real usage.
        prompt_tokens: the prompt estimate it reserved, tokens.
    """

    tenant: TenantConfig
    admission: AdmissionTicket
    prompt_tokens: int


class FleetLimits:
    """Authentication and fleet-wide rate limits of the router's tenants.

    Args:
        tenants: the tenants; None: no authentication, no limits (`enabled` is False).
        clock: time source of the token buckets.
    """

    def __init__(self, tenants: TenantsConfig | None, clock: Clock | None = None) -> None:
        self.tenants = tenants
        self._admission = AdmissionController(tenants, clock) if tenants is not None else None

    @property
    def enabled(self) -> bool:
        """True with a tenants file."""
        return self.tenants is not None

    def authenticate(self, api_key: str | None) -> TenantConfig:
        """The tenant of `api_key`.

        Raises:
            ServerError: 401 `invalid_api_key` for a missing or unknown key.
        """
        assert self.tenants is not None
        tenant = self.tenants.authenticate(api_key)
        if tenant is None:
            message = (
                "Missing API key: pass it as 'Authorization: Bearer KEY'."
                if not api_key
                else "Incorrect API key provided."
            )
            raise ServerError(401, message, code="invalid_api_key")
        return tenant

    def admit(
        self, tenant: TenantConfig, body: Mapping[str, Any], max_model_len: int
    ) -> FleetTicket:
        """Admit one request of `tenant` against its fleet-wide limits.

        Args:
            tenant: the authenticated tenant.
            body: the parsed request.
            max_model_len: the context length of the replicas serving its model, tokens (0 =
                unknown).

        Raises:
            ServerError: 429 with Retry-After and x-ratelimit-* headers.
        """
        assert self._admission is not None
        prompt = estimate_prompt_tokens(body)
        left = max(max_model_len - prompt, 0) if max_model_len > 0 else 0
        max_tokens = requested_max_tokens(body, left)
        prompt, max_tokens = _clamp(tenant, prompt, max_tokens)
        decision = self._admission.try_admit(tenant, prompt, max_tokens)
        if decision.ticket is None:
            raise rejection_error(decision)
        return FleetTicket(tenant, decision.ticket, prompt)

    def release(self, ticket: FleetTicket, used_tokens: int | None) -> None:
        """End an admitted request (idempotent).

        Args:
            ticket: from `admit`.
            used_tokens: the replica's `usage.total_tokens`; None when unknown (the prompt
                estimate is charged).
        """
        assert self._admission is not None
        used = ticket.prompt_tokens if used_tokens is None else used_tokens
        self._admission.release(ticket.admission, used)

    def ratelimit_headers(self, tenant: TenantConfig) -> dict[str, str]:
        """The tenant's x-ratelimit-* headers now (for admitted requests' responses)."""
        from sits.admission import ratelimit_headers

        assert self._admission is not None
        return ratelimit_headers(self._admission.snapshot(tenant))


def _clamp(tenant: TenantConfig, prompt: int, max_tokens: int) -> tuple[int, int]:
    """(prompt, max_tokens) within the tenant's per-request limits, which the replica checks
    exactly: the router's estimate must not turn into a 400."""
    if tenant.max_prompt_tokens is not None:
        prompt = min(prompt, tenant.max_prompt_tokens)
    if tenant.max_tokens_per_request is not None:
        max_tokens = min(max_tokens, tenant.max_tokens_per_request)
    if tenant.tokens_per_minute is not None:
        prompt = min(prompt, tenant.tokens_per_minute)
        max_tokens = min(max_tokens, tenant.tokens_per_minute - prompt)
    return prompt, max_tokens
