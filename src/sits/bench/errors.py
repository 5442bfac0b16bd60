"""The benchmark's own error: the run cannot start or go on (server unreachable, no model).

Bad flags and malformed files raise `sits.core.errors.InvalidParameterError` instead (naming
the flag or field); a single failed request is never an exception, it is a failed record.
"""

from __future__ import annotations

from sits.core.errors import SitsError


class BenchmarkError(SitsError, RuntimeError):
    """The benchmark cannot run: the server is unreachable, refuses the probe, or died."""
