"""sampling layer: per-request sampling state, logit penalties, the sampler and logprobs."""

from sits.sampling.batch import SamplingState, make_generator
from sits.sampling.logprobs import compute_prompt_logprobs
from sits.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "compute_prompt_logprobs", "make_generator"]
