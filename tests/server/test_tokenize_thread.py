"""Prompts are tokenized on the server's one tokenizer thread, never on the event loop."""

from __future__ import annotations

import threading

from tests.server.live import LiveServer


def test_prompts_are_tokenized_off_the_event_loop(server: LiveServer, monkeypatch) -> None:
    tokenizer = server.engine.tokenizer
    seen: list[str] = []
    original = tokenizer.encode

    def encode(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    with server.http() as http:
        for prompt in ("one prompt", ["two", "prompts"]):
            answer = http.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}
            )
            assert answer.status_code == 200, answer.text
    assert len(seen) == 3
    assert {name.rsplit("_", 1)[0] for name in seen} == {"sits-tokenize"}
