"""The printed benchmark command never shows an API key."""

from __future__ import annotations

from sits.bench.report import _redact_secrets


def test_api_key_values_are_redacted() -> None:
    argv = ["sits", "bench", "serve", "--api-key", "s3cret", "--api-key=k2", "--num-prompts", "8"]
    redacted = _redact_secrets(argv)
    assert redacted == [
        "sits",
        "bench",
        "serve",
        "--api-key",
        "***",
        "--api-key=***",
        "--num-prompts",
        "8",
    ]
    assert "s3cret" not in " ".join(redacted) and "k2" not in " ".join(redacted)
