"""sampling layer: per-request sampling state, logit penalties, the sampler and logprobs."""

from sits.sampling.logprobs import compute_prompt_logprobs
from sits.sampling.sampler import Sampler, SamplerOutput
from sits.sampling.state import SamplingState, make_generator

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "compute_prompt_logprobs", "make_generator"]
