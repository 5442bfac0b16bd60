"""`OutputObserver`: the hook that sees every output of one engine request.

The server's `GenerationJob` (`sits.server.jobs`) calls each request's observer (metrics,
tracing) on the event loop, in output order; observers never change what the client gets.
"""

from __future__ import annotations

from sits.core.outputs import RequestOutput


class OutputObserver:
    """Receives every output of one engine request (metrics); the default does nothing."""

    def on_output(self, output: RequestOutput) -> None:
        """Called for each output, in order, on the event loop."""

    def on_abort(self) -> None:
        """Called once when the request ends without a finished output (abort, failure)."""
