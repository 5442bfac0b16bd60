"""sits: multi-tenant LLM serving for dense and Mixture-of-Experts models.

The offline API mirrors vLLM's: `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`.
"""

from sits.core.outputs import CompletionOutput, Logprob, RequestOutput
from sits.core.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import sits` stays light.
    if name == "LLM":
        from sits.engine.llm import LLM

        return LLM
    raise AttributeError(name)
