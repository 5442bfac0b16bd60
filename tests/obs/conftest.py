"""Fixtures for the audit-log tests: a log path and a writer factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sits.obs.audit_writer import AuditWriter, AuditWriterConfig


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "audit.log"


@pytest.fixture
def open_writer(log_path: Path) -> Iterator[Callable[..., AuditWriter]]:
    """`open_writer(**config_overrides) -> AuditWriter` on `log_path`; all closed at the end."""
    writers: list[AuditWriter] = []

    def make(**overrides: object) -> AuditWriter:
        writer = AuditWriter(AuditWriterConfig(path=str(log_path), **overrides))
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.close()
