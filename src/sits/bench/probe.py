"""Before the timed run: find the served model and decide how prompts are made.

- `fetch_model` reads `GET /v1/models` (the first card) when `--model` is not given, and
  proves the server is reachable and accepts the key before any request is timed.
- `plan_prompts` picks the prompt form (see `sits.bench.prompts`):
  `token-ids` needs /v1/completions and a working `POST /tokenize` (sits and vLLM have it);
  `text` calibrates words-to-tokens with two probe requests (`max_tokens` 1, not streamed) of
  8 and W random words, reading `usage.prompt_tokens`, where W = input_len / 2 clamped to
  [16, 264] (large enough for a good fit, small enough for the context since a word is
  rarely more than two tokens); `auto` takes token ids when possible.
Probes are ordinary requests and also warm the server up; they are not part of the results.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import httpx

from sits.bench.client import COMPLETIONS, build_body, error_message
from sits.bench.errors import BenchmarkError
from sits.bench.prompts import WORDS, TextPrompts, TokenIdPrompts, random_words
from sits.core.errors import InvalidParameterError

logger = logging.getLogger(__name__)

PROMPT_FORMATS = ("auto", "token-ids", "text")
_PROBE_SMALL_WORDS = 8
_PROBE_MAX_WORDS = 264
# Used only when the server reports no usage: a typical BPE rate for common English words.
_GUESS_TOKENS_PER_WORD = 1.3


def normalize_base_url(base_url: str) -> str:
    """The server root: trailing "/" and a trailing "/v1" removed (both spellings work)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def fetch_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict:
    """The first model card of `GET /v1/models`.

    Raises:
        BenchmarkError: the server is unreachable, refuses the key, or lists no model.
    """
    try:
        response = await client.get(f"{base_url}/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise BenchmarkError(f"cannot reach {base_url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise BenchmarkError(
            f"GET {base_url}/v1/models answered {response.status_code}: "
            f"{error_message(response.content)}"
        )
    data = response.json().get("data") or []
    if not data:
        raise BenchmarkError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]


async def tokenize_pool(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str], model: str
) -> tuple[int, ...] | None:
    """Distinct token ids of `WORDS` from the server's /tokenize; None if it has none."""
    body = {"model": model, "prompt": " ".join(WORDS), "add_special_tokens": False}
    try:
        response = await client.post(f"{base_url}/tokenize", json=body, headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    tokens = response.json().get("tokens")
    if not isinstance(tokens, list) or not tokens:
        return None
    return tuple(sorted(set(int(t) for t in tokens)))


async def probe_prompt_tokens(
    client: httpx.AsyncClient,
    base_url: str,
    endpoint: str,
    headers: dict[str, str],
    model: str,
    text: str,
) -> int | None:
    """`usage.prompt_tokens` of a 1-token request with `text` as the prompt; None if absent.

    Raises:
        BenchmarkError: the probe failed (unreachable, refused, error status).
    """
    body = build_body(endpoint, model, text, 1, stream=False)
    try:
        response = await client.post(f"{base_url}{endpoint}", json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise BenchmarkError(f"probe request failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise BenchmarkError(
            f"probe request to {endpoint} answered {response.status_code}: "
            f"{error_message(response.content)}"
        )
    usage: Any = response.json().get("usage") or {}
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return int(count) if count is not None else None


async def calibrate_text(
    client: httpx.AsyncClient,
    base_url: str,
    endpoint: str,
    headers: dict[str, str],
    model: str,
    seed: int,
    input_len: int,
) -> TextPrompts:
    """Fit prompt tokens = overhead + tokens_per_word * words from two probes (see module).

    Args:
        input_len: the longest prompt the run asks for, in tokens (sizes the second probe).
    """
    rng = random.Random(seed)
    probe_words = (_PROBE_SMALL_WORDS, max(16, min(_PROBE_MAX_WORDS, input_len // 2)))
    counts = []
    for num_words in probe_words:
        text = random_words(num_words, rng)
        counts.append(await probe_prompt_tokens(client, base_url, endpoint, headers, model, text))
    if None in counts:
        logger.warning("the server reports no usage: guessing %.1f tokens per word",
                       _GUESS_TOKENS_PER_WORD)  # fmt: skip
        return TextPrompts(_GUESS_TOKENS_PER_WORD, 0.0, calibrated=False)
    (w1, w2), (c1, c2) = probe_words, counts
    slope = (c2 - c1) / (w2 - w1)
    if slope <= 0:
        raise BenchmarkError(f"probe prompt sizes make no sense: {w1}->{c1}, {w2}->{c2} tokens")
    return TextPrompts(slope, c1 - slope * w1)


async def plan_prompts(
    client: httpx.AsyncClient,
    base_url: str,
    endpoint: str,
    headers: dict[str, str],
    model: str,
    prompt_format: str,
    seed: int,
    input_len: int,
) -> TokenIdPrompts | TextPrompts:
    """The prompt maker for this server and endpoint (`input_len`: the longest prompt asked).

    Raises:
        InvalidParameterError("prompt_format"): token ids asked for where they cannot be used.
        BenchmarkError: a probe failed.
    """
    if prompt_format not in PROMPT_FORMATS:
        raise InvalidParameterError(
            "prompt_format", f"prompt format must be one of {PROMPT_FORMATS}"
        )
    if prompt_format != "text" and endpoint == COMPLETIONS:
        pool = await tokenize_pool(client, base_url, headers, model)
        if pool is not None:
            return TokenIdPrompts(pool)
        if prompt_format == "token-ids":
            raise InvalidParameterError(
                "prompt_format", f"{base_url}/tokenize is not available; use --prompt-format text"
            )
        logger.info("no /tokenize on the server: using calibrated text prompts")
    elif prompt_format == "token-ids":
        raise InvalidParameterError(
            "prompt_format", f"token-id prompts need {COMPLETIONS}, not {endpoint}"
        )
    return await calibrate_text(client, base_url, endpoint, headers, model, seed, input_len)
