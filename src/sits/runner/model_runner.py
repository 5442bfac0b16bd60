"""`ModelRunner`: runs one step of a `StepPlan` on the model and samples.

It owns everything on the device: the model weights, the paged KV cache, the persistent input
buffers, the decode CUDA graphs, and each request's sampling state (its random generator
survives preemption, so a seeded request gives the same tokens after it is resumed). Unseeded
requests draw their sampling noise together from the runner's own generator, seeded from the
engine seed (`Sampler`). It never imports the scheduler.

On CUDA with Triton the attention (and, when available, the MoE) run as Triton kernels and a
pure decode step replays a captured CUDA graph padded to the next captured batch size (unless
`enforce_eager`); with `mixed_step_cuda_graphs` (the default) a step with prompt chunks replays
the graph of its token bucket; everything else (the CPU, steps over the largest bucket) runs
eagerly. On CUDA the setup first runs eager dummy steps of every prefill shape class
(`runner.warmup`), so no live step waits for a Triton compile.

With `precision_switch` the runner holds two weight sets (`runner.precision`): `models` maps
each name to its model, each with its own warm-up and CUDA graphs over the one KV cache;
`set_precision` (between steps) picks the set the next steps run.

With `tensor_parallel_size` N > 1 the runner is one rank of N (`rank`; the default process
group is up, `sits.runner.tp_executor`): every rank takes the KV block count `agree_num_blocks`
gives (the smallest of all, so the one scheduler's block ids are valid everywhere) and no
CUDA graph is captured.
With `enable_expert_parallel` the rank's MoE layers hold whole experts (`layers.moe`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.core.outputs import TokenLogprobs
from sits.core.plan import (
    PLACEHOLDER_TOKEN_ID,
    NewRequestData,
    ScheduledRequest,
    StepPlan,
    StepResult,
)
from sits.layers.forward_context import ForwardContext
from sits.models.loader import load_model, resolve_model_path
from sits.parallel import TensorParallel
from sits.runner.backends import (
    graph_safe,
    moe_backend_name,
    select_attention_backend,
    select_moe_backend,
)
from sits.runner.cuda_graphs import (
    DecodeGraphs,
    MixedGraphs,
    graph_batch_sizes,
    mixed_token_buckets,
)
from sits.runner.expert_placement import ExpertPlacer
from sits.runner.input_buffers import InputBuffers
from sits.runner.kv_cache_alloc import (
    allocate_kv_caches,
    kv_bytes_per_block,
    kv_dtype_name,
    kv_fixed_bytes,
    num_kv_blocks,
)
from sits.runner.model_info import ModelInfo
from sits.runner.precision import load_twin, memory_budget_bytes, precision_name
from sits.runner.swap import HostKVTier, num_host_blocks
from sits.runner.warmup import WarmupReport, warm_up_kernels
from sits.sampling.batch import SamplingState, make_generator, needs_host_tokens, to_device
from sits.sampling.sampler import Sampler, compute_prompt_logprobs
from sits.sampling.structured import GrammarRows, grammar_cache_factory

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LaunchedStep:
    """A step `ModelRunner.launch` started: what `collect` and the next `launch` need.

    Attributes:
        plan: the step's plan.
        sampled_ids: ids of the requests it samples, in row order.
        token_ids: [num_sampled] int64 sampled tokens on the device, or None (none sampled).
        host_token_ids: (pinned host copy being made, its CUDA event or None on the CPU).
    """

    plan: StepPlan
    sampled_ids: list[str]
    token_ids: Tensor | None
    host_token_ids: tuple[Tensor, torch.cuda.Event | None] | None


class ModelRunner:
    """Model, KV cache and per-request sampling state on one device.

    Args:
        config: engine configuration (dtype, device, block size, KV memory).
        info: what the engine read from the checkpoint (dtype, eos ids, context length).
        warm_up: run the kernel warm-up (`runner.warmup`) at setup, before the CUDA graphs are
            captured; None = only on CUDA (on the CPU nothing is compiled).
        rank: this runner's tensor-parallel rank, in [0, config.tensor_parallel_size).
        agree_num_blocks: with several ranks, maps this rank's KV block count to the one all
            ranks use (the smallest, `sits.runner.tp_executor`); None: one rank.

    Attributes:
        device, dtype: where and in which dtype the model runs.
        models: weight set name -> model: the model dtype's ("bf16", "fp16", "fp32") and,
            with `config.precision_switch`, its "fp8" or "int4" twin.
        precision: the name of the set the steps run (`set_precision`); `model` is its model.
        num_blocks: KV blocks allocated.
        kv_cache_dtype: "auto" (model dtype), "fp8" or "int8" (config.kv_cache_dtype).
        kv_bytes_per_block: bytes one block takes across layers (data and int8 scales).
        kv_cache_bytes: bytes of the whole KV cache (blocks and fp8's fixed scales).
        num_host_blocks: blocks of the host tier (config.swap_space; 0 = none).
        host_kv: the host tier's tensors, or None.
        warmup: what the kernel warm-up ran, or None when it did not run.
        phase_s: cumulative wall seconds of `run`'s phases: "launch" (per-request state and
            the forward's inputs, up to its launch), "shadow" (the caller's `while_gpu_runs`)
            and "sync" (waiting for the forward, then sampling).
        num_rows_run: token rows the forwards ran, cumulative, CUDA-graph padding included.
        expert_placer: load-aware expert placement (`runner.expert_placement`), or None.
        grammar_rows: the constrained requests' grammar matchers (`sampling.structured`);
            its cache compiles grammars (the engine submits each request's at arrival).
    """

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        warm_up: bool | None = None,
        rank: int = 0,
        agree_num_blocks: Callable[[int], int] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.info = info
        self.device = info.device
        self.dtype = info.dtype
        self.block_size = config.block_size
        self.model = load_model(
            info.model_dir,
            dtype=self.dtype,
            device=self.device,
            moe_backend=select_moe_backend(self.device),
            load_format=config.load_format,
            seed=config.seed,
            num_spare_experts=config.num_spare_experts,
            quantization=config.quantization,
            tp=TensorParallel(rank, config.tensor_parallel_size, config.enable_expert_parallel),
        )
        self.model.eval()
        self.expert_placer = ExpertPlacer.of_model(self.model, config, rank)
        arch = self.model.arch
        self.kv_cache_dtype = config.kv_cache_dtype
        bytes_per_block = kv_bytes_per_block(
            arch.num_layers,
            self.block_size,
            arch.num_kv_heads,
            arch.head_dim,
            self.dtype,
            self.kv_cache_dtype,
        )
        fixed_bytes = kv_fixed_bytes(arch.num_layers, arch.num_kv_heads, self.kv_cache_dtype)
        self.kv_bytes_per_block = bytes_per_block
        self.precision = precision_name(self.dtype)
        self.models = {self.precision: self.model}
        if config.precision_switch is not None:
            min_kv_blocks = -(-info.max_model_len // self.block_size) + 1  # and the null block
            self.models[config.precision_switch] = load_twin(
                self.model,
                info.model_dir,
                config.precision_switch,
                moe_backend=select_moe_backend(self.device),
                min_kv_bytes=config.kv_cache_memory_bytes
                or max(min_kv_blocks, 2) * bytes_per_block + fixed_bytes,
                budget_bytes=memory_budget_bytes(
                    self.device,
                    None if config.kv_cache_memory_bytes else config.gpu_memory_utilization,
                ),
            )
        self.num_blocks = num_kv_blocks(
            bytes_per_block=bytes_per_block,
            device=self.device,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=info.max_model_len,
            max_num_seqs=config.max_num_seqs,
            block_size=self.block_size,
            fixed_bytes=fixed_bytes,
        )
        if agree_num_blocks is not None:
            self.num_blocks = agree_num_blocks(self.num_blocks)
        self.kv_caches = allocate_kv_caches(
            arch.num_layers,
            self.num_blocks,
            self.block_size,
            arch.num_kv_heads,
            arch.head_dim,
            self.dtype,
            self.device,
            self.kv_cache_dtype,
        )
        self.kv_cache_bytes = bytes_per_block * self.num_blocks + fixed_bytes
        logger.info(
            "KV cache dtype %s: %d blocks of %d bytes (%d tokens each; block 0 is the null "
            "block, %d hold requests' KV)",
            kv_dtype_name(self.kv_cache_dtype, self.dtype),
            self.num_blocks,
            bytes_per_block,
            self.block_size,
            self.num_blocks - 1,
        )
        self.num_host_blocks = num_host_blocks(config.swap_space, bytes_per_block)
        self.host_kv: HostKVTier | None = None
        if self.num_host_blocks > 0:
            self.host_kv = HostKVTier(self.kv_caches, self.num_host_blocks)
            logger.info("host KV tier: %d blocks", self.num_host_blocks)
        self._setup_fast_path(config, arch.num_kv_heads, arch.head_dim, warm_up)
        # The unseeded requests' shared generator: from the engine seed, but not equal to the
        # generator of a request whose own seed is the engine seed.
        shared_seed = random.Random(f"sits-sampler-{config.seed}").getrandbits(63)
        self.sampler = Sampler(make_generator(shared_seed, self.device))
        self._seed_source = random.Random(config.seed)
        tokenizer = config.tokenizer or config.model  # read even with skip_tokenizer_init
        eos_ids = info.eos_token_ids
        self.grammar_rows = GrammarRows(
            grammar_cache_factory(tokenizer, resolve_model_path, arch.vocab_size, eos_ids)
        )
        self._states: dict[str, SamplingState] = {}
        self._prompt_logprob_ids: set[str] = set()  # requests that asked for prompt logprobs
        # Prompt logprobs already returned per request (a resumed request recomputes its
        # prompt, but each prompt position is reported once).
        self._prompt_logprobs_done: dict[str, int] = {}
        self.phase_s = {"launch": 0.0, "shadow": 0.0, "sync": 0.0}
        self.num_rows_run = 0
        self._sync_ids: set[str] = set()  # requests `launch` cannot run (`needs_host_tokens`)
        pin = self.device.type == "cuda"
        self._read_back_buffers = [
            torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]  # [max_num_seqs] each: sampled tokens read back (`_read_back`)
        self._read_back_turn = 0

    def _setup_fast_path(
        self, config: EngineConfig, num_kv_heads: int, head_dim: int, warm_up: bool | None
    ) -> None:
        """Pick the attention backend, make the persistent input buffers, warm up the kernels
        (`warm_up`, None = on CUDA) and, when the model and backend allow it and
        `enforce_eager` is off, capture the decode CUDA graphs: for each weight set, the
        other set's graphs sharing the memory pools."""
        self.attn_backend = select_attention_backend(self.device, head_dim, self.kv_cache_dtype)
        self.buffers = InputBuffers(
            max_num_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            max_num_seqs=config.max_num_seqs,
            max_blocks_per_seq=-(-self.info.max_model_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
        )
        self.warmup: WarmupReport | None = None
        if warm_up is None:
            warm_up = self.device.type == "cuda"  # on the CPU nothing is compiled
        if warm_up:
            # No request owns a block yet: the dummy steps' KV writes land in free blocks.
            for model in reversed(self.models.values()):  # the model dtype's report is kept
                self.warmup = warm_up_kernels(
                    model,
                    self.buffers,
                    self.kv_caches,
                    self.attn_backend,
                    max_model_len=self.info.max_model_len,
                )
        self._graph_sets: dict[str, tuple[DecodeGraphs | None, MixedGraphs | None]] = {}
        pools: tuple[object, object] = (None, None)
        for name, model in self.models.items():
            graphs = self._capture_graphs(config, model, num_kv_heads, head_dim, pools)
            self._graph_sets[name] = graphs
            pools = tuple(g.pool if g is not None else p for g, p in zip(graphs, pools))
        self.graphs, self.mixed_graphs = self._graph_sets[self.precision]
        logger.info(
            "attention %s, MoE %s, decode CUDA graphs: %s, mixed-step CUDA graphs: %s",
            type(self.attn_backend).__name__,
            moe_backend_name(self.model),
            self.graphs.batch_sizes if self.graphs else "off",
            self.mixed_graphs.token_buckets if self.mixed_graphs else "off",
        )

    def _capture_graphs(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        num_kv_heads: int,
        head_dim: int,
        pools: tuple[object, object],
    ) -> tuple[DecodeGraphs | None, MixedGraphs | None]:
        """One weight set's (decode graphs, mixed-step graphs), each None when not captured
        (`enforce_eager`, more than one rank, a model or backend that is not graph safe,
        mixed graphs off); captured into `pools` (decode, mixed; None: new ones)."""
        if (
            config.enforce_eager
            or config.tensor_parallel_size > 1
            or not graph_safe(model, self.attn_backend)
        ):
            return None, None
        graphs = DecodeGraphs(model, self.buffers, self.kv_caches, num_kv_heads, head_dim)
        graphs.capture(graph_batch_sizes(config.max_num_seqs), pools[0])
        if not config.mixed_step_cuda_graphs:
            return graphs, None
        mixed = MixedGraphs(
            model, self.buffers, self.kv_caches, num_kv_heads, head_dim, config.max_num_seqs
        )
        mixed.capture(mixed_token_buckets(self.buffers.max_num_tokens), pools[1])
        return graphs, mixed

    def set_precision(self, name: str) -> None:
        """Run the weight set `name` from the next step on (call between steps only: a step
        already launched finishes on the weights it started with). The KV cache, the input
        buffers and every request's state are untouched.

        Raises:
            InvalidParameterError: `name` is not one of `models` ("precision").
        """
        if name not in self.models:
            raise InvalidParameterError(
                "precision",
                f"unknown precision {name!r}; this engine has {', '.join(self.models)}",
            )
        self.precision = name
        self.model = self.models[name]
        self.graphs, self.mixed_graphs = self._graph_sets[name]

    def shutdown(self) -> None:
        """Release what outlives the runner's objects: nothing on one device (the tensors go
        with it); `TensorParallelRunner` stops its workers."""

    @property
    def step_token_buckets(self) -> tuple[int, ...]:
        """Token counts a step with prompt tokens is padded to (its mixed-step CUDA graph),
        ascending; empty when such steps run eagerly, unpadded."""
        return tuple(self.mixed_graphs.token_buckets) if self.mixed_graphs else ()

    @torch.inference_mode()
    def run(self, plan: StepPlan, while_gpu_runs: Callable[[], None] | None = None) -> StepResult:
        """Compute the plan's tokens, write their KV, and sample where `sample` is set.

        Args:
            plan: requests and tokens of this step.
            while_gpu_runs: host work to do once the step's forward is launched, before the
                sampled tokens are waited for (on a GPU it overlaps the device's work); called
                once, and not at all for an empty plan.

        Returns:
            StepResult with one sampled token per request with `sample=True`, plus logprobs
            and prompt logprobs where asked.
        """
        start_s = time.monotonic()
        self._begin(plan)
        result = StepResult()
        if plan.is_empty:
            return result
        if self.expert_placer is not None:  # every rank runs every plan: all check alike
            self.expert_placer.before_step()
        hidden, last_indices = self._forward(plan)  # [num_tokens (+ padding), hidden]
        self.num_rows_run += hidden.shape[0]
        launched_s = time.monotonic()
        if while_gpu_runs is not None:
            while_gpu_runs()
        shadow_end_s = time.monotonic()
        if self._prompt_logprob_ids:
            self._prompt_logprobs(plan, last_indices, hidden, result)
        self._sample(plan, last_indices, hidden, result)
        phase_s = self.phase_s
        phase_s["launch"] += launched_s - start_s
        phase_s["shadow"] += shadow_end_s - launched_s
        phase_s["sync"] += time.monotonic() - shadow_end_s
        return result

    def _begin(self, plan: StepPlan) -> None:
        """A step's bookkeeping before its forward: drop finished requests' sampling state,
        make new requests' state, and copy the planned KV swaps."""
        for request_id in plan.finished_request_ids:
            self._states.pop(request_id, None)
            self._prompt_logprobs_done.pop(request_id, None)
            self._prompt_logprob_ids.discard(request_id)
            self._sync_ids.discard(request_id)
            self.grammar_rows.drop(request_id)
        for new in plan.new_requests:
            self._states[new.request_id] = self._new_state(new)
            params = new.sampling_params
            if params.structured_outputs is not None:
                self.grammar_rows.add(new.request_id, params.structured_outputs)
            if params.prompt_logprobs is not None:
                self._prompt_logprob_ids.add(new.request_id)
            if needs_host_tokens(params):
                self._sync_ids.add(new.request_id)
        if plan.swap_out or plan.swap_in:
            assert self.host_kv is not None, "swaps planned without a host tier"
            self.host_kv.copy_blocks(self.kv_caches, plan.swap_out, plan.swap_in)

    def can_launch(self, plan: StepPlan) -> bool:
        """True when `launch` may run the plan: none of its requests asks for logprobs,
        prompt logprobs or penalties (those need every token on the host first)."""
        sync_ids = self._sync_ids
        if sync_ids and any(sr.request_id in sync_ids for sr in plan.scheduled):
            return False
        return not any(needs_host_tokens(new.sampling_params) for new in plan.new_requests)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous: LaunchedStep | None) -> LaunchedStep:
        """Async scheduling: start the plan's forward and sampling on the device and return
        without waiting for them; `collect` reads the tokens back.

        Args:
            plan: a non-empty plan that `can_launch` accepts. Its placeholder input ids
                (`core.plan.PLACEHOLDER_TOKEN_ID`, each a request's last token) are the
                tokens `previous` sampled; the device fills them in before the forward.
            previous: the step launched before this one, not collected yet, or None.

        Returns:
            The launched step, to pass to `collect` (and to the next `launch`).
        """
        start_s = time.monotonic()
        self._begin(plan)
        hidden, last_indices = self._forward(plan, previous)  # [num_tokens (+ padding), hidden]
        self.num_rows_run += hidden.shape[0]
        to_sample = self._logits_to_sample(plan, last_indices, hidden)
        ids = to_sample[0] if to_sample is not None else []
        launched = LaunchedStep(plan, ids, None, None)
        if to_sample is not None:
            _, states, logits = to_sample
            launched.token_ids = self.sampler.sample_tokens(logits, states)  # [num_sampled]
            launched.host_token_ids = self._read_back(launched.token_ids)
        self.phase_s["launch"] += time.monotonic() - start_s
        return launched

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's sampled tokens and return them as its `StepResult`."""
        start_s = time.monotonic()
        result = StepResult()
        if launched.host_token_ids is not None:
            host, event = launched.host_token_ids
            if event is not None:
                event.synchronize()
            result.sampled_token_ids.update(zip(launched.sampled_ids, host.tolist()))
        self.phase_s["sync"] += time.monotonic() - start_s
        return result

    def _read_back(self, token_ids: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """Start copying [n] sampled tokens to pinned host memory (two buffers taken in turn:
        a step's copy is read before the buffer comes round again); (host view, event)."""
        n = token_ids.shape[0]
        if self.device.type != "cuda":
            return token_ids, None
        self._read_back_turn ^= 1
        host = self._read_back_buffers[self._read_back_turn][:n]
        host.copy_(token_ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _feed(self, plan: StepPlan, previous: LaunchedStep, input_ids: Tensor) -> None:
        """Write the tokens `previous` sampled into the prepared step's placeholder input ids
        (on the device, in stream order after `previous`'s sampling)."""
        dst_rows: list[int] = []
        src_rows: list[int] = []
        row_of = {request_id: row for row, request_id in enumerate(previous.sampled_ids)}
        offset = 0
        for sr in plan.scheduled:
            offset += len(sr.token_ids)
            if sr.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                dst_rows.append(offset - 1)
                src_rows.append(row_of[sr.request_id])
        if not dst_rows:
            return
        assert previous.token_ids is not None
        dst = to_device(dst_rows, torch.long, self.device)  # [n]
        src = to_device(src_rows, torch.long, self.device)  # [n]
        input_ids.index_copy_(0, dst, previous.token_ids.index_select(0, src))

    def _forward(
        self, plan: StepPlan, previous: LaunchedStep | None = None
    ) -> tuple[Tensor, list[int]]:
        """The step's hidden states: a graph replay for a pure decode step that fits a captured
        size, else an eager forward. With `previous` (async scheduling), its sampled tokens
        replace the plan's placeholder input ids first (`_feed`).

        Returns:
            ([num_tokens (+ padding rows), hidden_size] hidden states, the flat index of each
            scheduled request's last token).
        """
        graph_size = bucket = None
        scheduled = plan.scheduled  # len(), not the num_tokens property: every request, step
        if self.graphs is not None and all(len(sr.token_ids) == 1 for sr in scheduled):
            graph_size = self.graphs.padded_size(len(scheduled))
        elif self.mixed_graphs is not None:
            bucket = self.mixed_graphs.padded_tokens(sum([len(sr.token_ids) for sr in scheduled]))
        if bucket is not None:  # a mixed-step graph: padded to its sequences and tokens
            inputs = self.buffers.prepare(
                plan, pad_to_seqs=self.mixed_graphs.max_num_seqs, pad_to_tokens=bucket
            )
        else:
            inputs = self.buffers.prepare(plan, pad_to_seqs=graph_size)
        if previous is not None:
            self._feed(plan, previous, inputs.input_ids)
        if bucket is not None:
            return self.mixed_graphs.replay(bucket), inputs.last_token_indices
        if graph_size is not None:
            return self.graphs.replay(graph_size), inputs.last_token_indices
        ctx = ForwardContext(
            inputs.metadata, self.kv_caches, self.attn_backend, token_mask=inputs.token_mask
        )
        return self.model(inputs.input_ids, inputs.positions, ctx), inputs.last_token_indices

    def _new_state(self, new: NewRequestData) -> SamplingState:
        return SamplingState.create(
            new.sampling_params,
            new.prompt_token_ids,
            self.info.eos_token_ids,
            self._seed_source,
            device=self.device,
        )

    def _sample(
        self, plan: StepPlan, last_indices: list[int], hidden: Tensor, result: StepResult
    ) -> None:
        """Sample the requests with `sample` set (rows `last_indices` of `hidden`, [num_rows,
        hidden_size]) into `result`."""
        to_sample = self._logits_to_sample(plan, last_indices, hidden)
        if to_sample is None:
            return
        ids, states, logits = to_sample
        grammars = self.grammar_rows
        if grammars:  # the grammar masks go first: the sampler sees the allowed tokens only
            grammars.mask(ids, [state.output_token_ids for state in states], logits)
        out = self.sampler(logits, states)
        result.sampled_token_ids.update(zip(ids, out.token_ids))
        if grammars:
            result.grammar_ended.update(grammars.accept(ids, out.token_ids))
        if out.logprobs.count(None) < len(ids):
            for request_id, logprobs in zip(ids, out.logprobs):
                if logprobs is not None:
                    result.logprobs[request_id] = logprobs

    def _logits_to_sample(
        self, plan: StepPlan, last_indices: list[int], hidden: Tensor
    ) -> tuple[list[str], list[SamplingState], Tensor] | None:
        """The requests with `sample` set: their ids and sampling states (each given its
        request's output list) and the [num_sampled, vocab] float32 logits of their last
        tokens (rows `last_indices` of `hidden`, [num_rows, hidden_size]); None when the step
        samples nothing. The lists are built by comprehensions: with 256 decodes this runs for
        every request in every step."""
        scheduled = plan.scheduled
        picked = [sr for sr in scheduled if sr.sample]
        if not picked:
            return None
        if len(picked) == len(scheduled):  # a decode step samples every request
            rows = last_indices
        else:
            rows = [last for sr, last in zip(scheduled, last_indices) if sr.sample]
        ids = [sr.request_id for sr in picked]
        states_by_id = self._states
        states = [states_by_id[request_id] for request_id in ids]
        for state, sr in zip(states, picked):
            state.output_token_ids = sr.output_token_ids
        # Last-token rows are increasing: rows == 0..k-1 (a decode batch) is a plain slice.
        if rows[-1] == len(rows) - 1:
            last_hidden = hidden[: len(rows)]
        else:  # no wait for the device to copy the index (async scheduling launches ahead)
            last_hidden = hidden.index_select(0, to_device(rows, torch.long, self.device))
        return ids, states, self.model.compute_logits(last_hidden)

    def _prompt_logprobs(
        self, plan: StepPlan, last_indices: list[int], hidden: Tensor, result: StepResult
    ) -> None:
        """Logprobs of prompt tokens computed this step (token p+1 from position p's logits)."""
        for sr, last in zip(plan.scheduled, last_indices):
            state = self._states[sr.request_id]
            num_top = state.params.prompt_logprobs
            if num_top is None:
                continue
            entries = self._prompt_logprobs_of(sr, last, hidden, state, num_top)
            if entries:
                result.prompt_logprobs[sr.request_id] = entries

    def _prompt_logprobs_of(
        self,
        sr: ScheduledRequest,
        last: int,
        hidden: Tensor,
        state: SamplingState,
        num_top: int,
    ) -> list[TokenLogprobs | None]:
        prompt = state.prompt_token_ids
        done = self._prompt_logprobs_done.get(sr.request_id, 0)
        first_flat = last - sr.num_tokens + 1
        entries: list[TokenLogprobs | None] = []
        if sr.start_position == 0 and done == 0:
            entries.append(None)  # the first prompt token has no logprob
            done = 1
        # Positions p in this chunk whose next token p+1 is a prompt token not yet reported.
        first_pos = max(sr.start_position, done - 1)
        end_pos = min(sr.start_position + sr.num_tokens, len(prompt) - 1)
        if first_pos < end_pos:
            rows = [first_flat + p - sr.start_position for p in range(first_pos, end_pos)]
            logits = self.model.compute_logits(hidden[rows])  # [n, vocab] float32
            targets = torch.tensor(prompt[first_pos + 1 : end_pos + 1], device=logits.device)
            entries.extend(compute_prompt_logprobs(logits, targets, num_top))
            done = end_pos + 1
        self._prompt_logprobs_done[sr.request_id] = done
        return entries
