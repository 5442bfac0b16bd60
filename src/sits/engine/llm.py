"""`LLM`: the offline, synchronous API (vLLM's `LLM`): generate and chat over a batch of prompts.

All prompts are queued at once and the engine steps until every one has finished, so they
are batched continuously. Outputs come back in the order of the prompts. A step's outputs
are detokenized and checked for stop strings while the device runs the next step (the
runner's `while_gpu_runs`); a stop string so found ends its request after that step, whose
one extra token is dropped, so outputs are as if checked at once.
With `skip_tokenizer_init=True` prompts must be token ids ({"prompt_token_ids": [...]}),
outputs carry token ids and empty text, and stop strings and `chat` are refused.
With spare expert slots (`num_spare_experts` > 0) the MoE experts are read every
`EXPERT_READ_PERIOD_STEPS` steps and after each call (`ExpertMonitor.read` with
`auto_restore`): an expert the health check froze is reloaded into a spare slot between
steps and unfrozen, as in `AsyncLLM`.
A call shows vLLM's "Processed prompts" progress bar on stderr (`use_tqdm`), advanced as each
prompt finishes, with the estimated input and output speed in tokens/s.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, SitsError
from sits.core.outputs import EngineCoreOutput, RequestOutput
from sits.core.precision import PrecisionState
from sits.core.request import FinishReason
from sits.core.sampling_params import RequestOutputKind, SamplingParams
from sits.engine.builder import build_engine
from sits.engine.output_processor import OutputProcessor, child_request_ids, make_engine_requests
from sits.engine.tokenizer import Tokenizer
from sits.runner.expert_health import ExpertMonitor
from sits.sampling.grammar import check_structured_outputs

PromptType = str | dict[str, Any]
ProgressType = bool | Callable[..., tqdm]
EXPERT_READ_PERIOD_STEPS = 8


class LLM:
    """Loads a model and generates for batches of prompts.

    Args:
        model: checkpoint directory or Hugging Face id.
        **kwargs: any `EngineConfig` field (dtype, device, seed, max_model_len, max_num_seqs,
            max_num_batched_tokens, block_size, kv_cache_memory_bytes, enable_prefix_caching...).

    Attributes:
        experts: the MoE experts' monitor with spare expert slots (restores frozen experts),
            else None.

    Raises:
        ModelNotFoundError, UnsupportedModelError: the model cannot be loaded.
        TypeError: an unknown keyword argument.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        parts = build_engine(self.config)
        self.engine_core = parts.core
        self.tokenizer = parts.tokenizer
        self.info = parts.info
        self._counter = itertools.count()
        self.experts: ExpertMonitor | None = None
        if self.config.num_spare_experts > 0:
            monitor = ExpertMonitor.of_runner(
                parts.core.runner, model_dir=parts.info.model_dir, auto_restore=True
            )
            self.experts = monitor if monitor.blocks else None

    def shutdown(self) -> None:
        """Stop the engine: with `tensor_parallel_size` > 1 its worker processes are joined
        (`EngineCore.shutdown`). Idempotent; no call may follow."""
        self.engine_core.shutdown()

    def set_precision(self, name: str) -> PrecisionState:
        """Run weight set `name` ("fp8" / "int4" or the model dtype's, see
        `precision_state().available`) from the next step on (`EngineConfig.precision_switch`).

        Raises:
            InvalidParameterError: no precision switch configured, or an unknown name.
        """
        return self.engine_core.set_precision(name)

    def precision_state(self) -> PrecisionState:
        """The engine's weight sets and the last switch."""
        return self.engine_core.precision_state()

    def get_tokenizer(self) -> Tokenizer | None:
        """The tokenizer; None with `skip_tokenizer_init`."""
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressType = True,
    ) -> list[RequestOutput]:
        """Generate completions.

        Args:
            prompts: a string, a dict {"prompt_token_ids": [...]} (or {"prompt": str}), or a
                list of them.
            sampling_params: one for all prompts, one per prompt, or None for the defaults.
            use_tqdm: show a progress bar over the prompts on stderr (True, as vLLM), none
                (False), or a callable taking tqdm's arguments that makes the bar.

        Returns:
            One finished RequestOutput per prompt, in prompt order.

        Raises:
            InvalidParameterError / PromptTooLongError: a prompt or parameter is invalid; no
                request of the call is run then.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, self._params_list(sampling_params, len(encoded)), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: ProgressType = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with the tokenizer's chat template.

        Args:
            messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
            sampling_params: as for `generate`.
            add_generation_prompt: end the rendered prompt with the assistant turn's header.
            use_tqdm: as for `generate`.

        Returns:
            One finished RequestOutput per conversation; its `prompt` is the rendered text.
        """
        tokenizer = self._require_tokenizer("messages")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        encoded = []
        for conversation in conversations:
            text = tokenizer.render_chat(conversation, add_generation_prompt)
            encoded.append((text, tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, self._params_list(sampling_params, len(encoded)), use_tqdm)

    def _require_tokenizer(self, param: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidParameterError(
                param, "the engine was built with skip_tokenizer_init: give prompt_token_ids"
            )
        return self.tokenizer

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer("prompt").encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self._require_tokenizer("prompt").encode(prompt["prompt"])
        raise InvalidParameterError("prompt", f"unsupported prompt type: {type(prompt).__name__}")

    @staticmethod
    def _params_list(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise InvalidParameterError(
                "sampling_params", f"got {len(sampling_params)} sampling params for {n} prompts"
            )
        return list(sampling_params)

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        use_tqdm: ProgressType,
    ) -> list[RequestOutput]:
        core = self.engine_core
        processor = OutputProcessor(self.tokenizer)
        batches = []
        for (prompt, ids), params in zip(encoded, params_list):
            if params.stop and self.tokenizer is None:
                raise InvalidParameterError(
                    "stop",
                    "stop strings need a tokenizer (the engine skips it): use stop_token_ids",
                )
            if params.structured_outputs is not None:  # refused now, not as a failed compile
                check_structured_outputs(params.structured_outputs, "structured_outputs")
            params = _final_only(params)
            request_id = str(next(self._counter))
            children = make_engine_requests(
                request_id,
                ids,
                params,
                eos_token_ids=self.info.eos_token_ids,
                max_model_len=self.info.max_model_len,
                enable_prefix_caching=self.config.enable_prefix_caching,
            )
            batches.append((request_id, prompt, ids, params, children))
        queued: list[str] = []
        try:  # `add_request` checks each request once; one that can never run ends the call
            for _, _, _, _, children in batches:
                for child in children:
                    core.add_request(child)
                    queued.append(child.request_id)
        except SitsError:
            core.finish_requests(queued)  # none of them has run: nothing of the call runs
            raise
        finished: dict[str, RequestOutput] = {}
        for request_id, prompt, ids, params, children in batches:
            processor.add_request(
                request_id,
                child_request_ids(request_id, params.n),
                prompt,
                ids,
                params,
                children[0].arrival_time,
            )
        progress = _Progress(use_tqdm, len(batches)) if use_tqdm else None
        try:
            self._step_until_done(processor, finished, progress)
        finally:
            if progress is not None:
                progress.close()
        return [finished[b[0]] for b in batches]

    def _step_until_done(
        self,
        processor: OutputProcessor,
        finished: dict[str, RequestOutput],
        progress: _Progress | None,
    ) -> None:
        """Step the engine until no request is left, filling `finished` (request id -> its
        final output) and advancing `progress` as each request finishes."""
        core = self.engine_core
        # A step's outputs are processed (detokenized, stop strings checked) while the device
        # runs the next step; a stop string found there ends its request after that step,
        # whose one extra token the processor ignores (its sample is finished).
        pending: tuple[list[EngineCoreOutput], float] | None = None
        stops: list[tuple[str, str]] = []

        def take_pending() -> None:
            nonlocal pending
            if pending is None:
                return
            processed = processor.process(*pending)
            pending = None
            stops.extend(processed.stop_requests)
            for _, out in processed.request_outputs:
                if out.finished:
                    finished[out.request_id] = out
                    if progress is not None:
                        progress.finished(out)

        while True:
            if core.has_unfinished_requests():
                outputs = core.step(take_pending)
                take_pending()  # a step with nothing scheduled does not call it
                pending = (outputs, time.monotonic())
                num_steps = core.stats.num_steps
                if self.experts is not None and num_steps % EXPERT_READ_PERIOD_STEPS == 0:
                    self.experts.read(num_steps)  # between steps: may restore experts
            elif pending is not None:
                take_pending()  # the last step's outputs
            else:
                break
            for child_id, stop_str in stops:
                core.finish_requests([child_id], FinishReason.STOP, stop_str)
            stops.clear()
        if self.experts is not None:
            self.experts.read(core.stats.num_steps)


class _Progress:
    """vLLM's "Processed prompts" bar over one call's requests: advanced as each finishes,
    its postfix the estimated input and output speed (tokens of the finished requests per
    second of the call so far).

    Args:
        use_tqdm: True (a `tqdm` bar on stderr) or a callable taking tqdm's arguments.
        total: the call's requests.
    """

    def __init__(self, use_tqdm: ProgressType, total: int) -> None:
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        self._bar = make_bar(
            total=total,
            desc="Processed prompts",
            dynamic_ncols=True,
            postfix=_speed_text(0.0, 0.0),
        )
        self._num_input_tokens = 0
        self._num_output_tokens = 0

    def finished(self, output: RequestOutput) -> None:
        """Count a finished request (its prompt and all its samples' tokens)."""
        self._num_input_tokens += len(output.prompt_token_ids)
        self._num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed_s = max(self._bar.format_dict["elapsed"], 1e-9)
        self._bar.postfix = _speed_text(
            self._num_input_tokens / elapsed_s, self._num_output_tokens / elapsed_s
        )
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _speed_text(input_tokens_per_s: float, output_tokens_per_s: float) -> str:
    return (
        f"est. speed input: {input_tokens_per_s:.2f} toks/s, "
        f"output: {output_tokens_per_s:.2f} toks/s"
    )


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
