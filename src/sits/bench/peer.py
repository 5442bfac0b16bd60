"""The transformers peer of `sits bench throughput --peer transformers`.

Hugging Face transformers' continuous batching (`model.generate_batch`) runs the same prompts
(token ids) with the same output length, greedy and without EOS, on the same weights:
- a real checkpoint: `from_pretrained` of the same directory;
- dummy weights (`--random-weights` / `--load-format dummy`): the model is made with
  `from_config` on the device, then every parameter is overwritten with sits' dummy values
  through the loader's name mapping (`checkpoint_target`): each of our (fused) parameters is
  drawn with `dummy_tensor` exactly as the engine's loader draws it, on the same device, and
  its slices are copied into the transformers parameters (q/k/v from qkv_proj, gate/up from
  gate_up_proj, experts from w13/w2). Every transformers parameter is written exactly once.

Attention: transformers < 5.23 needs the "paged|sdpa" name for continuous batching; later
releases take "sdpa" (generate_batch switches to a paged implementation itself).
Timing: the span from the first request's creation to the last one's end (`GenerationOutput`
created_time / lifespan), which leaves out the manager's setup and CUDA-graph warm-up; the
call's wall time is kept too.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

import torch

from sits.core.errors import UnsupportedModelError
from sits.models.dummy import dummy_tensor
from sits.models.loader import build_meta_model, checkpoint_target

_PEER_BLOCK_TOKENS = 256  # transformers' default KV block (page) size in 5.17 and 5.24


@dataclass(frozen=True, slots=True)
class PeerResult:
    """What the peer did.

    Attributes:
        name: "transformers".
        version: the transformers version.
        attn_implementation: the attention implementation asked for.
        elapsed_s: first request created -> last request finished.
        wall_s: the whole generate_batch call (setup and warm-up included).
        num_output_tokens: tokens generated over all prompts.
        output_token_ids: per prompt (in prompt order), the generated tokens.
    """

    name: str
    version: str
    attn_implementation: str
    elapsed_s: float
    wall_s: float
    num_output_tokens: int
    output_token_ids: list[list[int]]


def default_attn_implementation(version: str) -> str:
    """ "paged|sdpa" for transformers < 5.23 (needs the prefix), "sdpa" from 5.23 on."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return "paged|sdpa" if (major, minor) < (5, 23) else "sdpa"


def fill_with_dummy_weights(hf_model: torch.nn.Module, model_dir: str, seed: int) -> None:
    """Overwrite every parameter of a transformers model with sits' dummy weights of `seed`.

    Args:
        hf_model: a transformers causal LM of model_dir's config, on its device and dtype.
        model_dir: the checkpoint (or shape) directory both models are built from.
        seed: the dummy weights' seed (`EngineConfig.seed`).

    Raises:
        UnsupportedModelError: a transformers parameter has no counterpart in our model.
    """
    ours = build_meta_model(model_dir)  # meta device: names and shapes only
    our_params = dict(ours.named_parameters())
    parts: dict[str, list[tuple[torch.Tensor, tuple]]] = {}
    unmapped = []
    for name, param in hf_model.named_parameters():
        target = checkpoint_target(ours, name)
        if target is None:
            unmapped.append(name)
            continue
        parts.setdefault(target[0], []).append((param, target[1]))
    if unmapped:
        raise UnsupportedModelError(f"transformers parameters without a sits weight: {unmapped}")
    with torch.no_grad():
        for our_name, destinations in parts.items():
            meta = our_params[our_name]
            sample = destinations[0][0]
            value = dummy_tensor(our_name, tuple(meta.shape), sample.dtype, sample.device, seed)
            for param, index in destinations:
                part = value[index] if index else value
                if tuple(part.shape) != tuple(param.shape):
                    raise UnsupportedModelError(
                        f"{our_name}{list(index)} has shape {tuple(part.shape)}, the "
                        f"transformers parameter {tuple(param.shape)}"
                    )
                param.copy_(part)
            del value


def build_peer_model(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    dummy_seed: int | None,
) -> Any:
    """The transformers model of model_dir on `device` (dummy weights when dummy_seed is set)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy_seed is None:
        # device_map needs accelerate; without it the weights go through host memory.
        placement = {"device_map": str(device)} if find_spec("accelerate") else {}
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attn_implementation, **placement
        ).to(device)
    else:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation
            )
        fill_with_dummy_weights(model, model_dir, dummy_seed)
    model.eval()
    model.requires_grad_(False)
    return model


def _cb_config(
    device: torch.device, prompts: list[list[int]], output_len: int, num_blocks: int | None
) -> Any:
    """transformers' ContinuousBatchingConfig: automatic sizing on a GPU; on the CPU (where the
    automatic sizing is slow, or fails without psutil) just enough KV blocks and batch tokens
    for every prompt at once."""
    from transformers.generation import ContinuousBatchingConfig

    if device.type != "cpu":
        return ContinuousBatchingConfig(num_blocks=num_blocks)
    if num_blocks is None:
        per_prompt = -(-(max(len(p) for p in prompts) + output_len) // _PEER_BLOCK_TOKENS)
        num_blocks = per_prompt * len(prompts) + 1
    max_batch_tokens = sum(len(p) for p in prompts) + len(prompts)
    return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)


def run_transformers_peer(
    model_dir: str,
    prompts: list[list[int]],
    output_len: int,
    dtype: torch.dtype,
    device: torch.device,
    dummy_seed: int | None,
    attn_implementation: str | None = None,
    num_blocks: int | None = None,
) -> PeerResult:
    """Run `generate_batch` over `prompts` (greedy, no EOS, exactly output_len new tokens).

    The model is freed (and the CUDA cache emptied) before returning, so the engine can load.

    Args:
        model_dir: checkpoint or shape directory.
        prompts: token ids per prompt.
        output_len: new tokens per prompt.
        dtype, device: as the engine's.
        dummy_seed: sits' dummy-weight seed, or None to load the checkpoint's weights.
        attn_implementation: None = `default_attn_implementation` of the installed version.
        num_blocks: transformers' KV blocks (None = its automatic sizing; on the CPU enough
            for all prompts).
    """
    import transformers
    from transformers import GenerationConfig

    version = transformers.__version__
    attn = attn_implementation or default_attn_implementation(version)
    model = build_peer_model(model_dir, dtype, device, attn, dummy_seed)
    generation_config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    start_s = time.perf_counter()
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=generation_config,
        continuous_batching_config=_cb_config(device, prompts, output_len, num_blocks),
    )
    wall_s = time.perf_counter() - start_s
    results = list(outputs.values())
    errors = [r.error for r in results if r.error is not None]
    if errors or len(results) != len(prompts):
        raise RuntimeError(
            f"transformers generate_batch returned {len(results)} of {len(prompts)} results; "
            f"errors: {errors[:3]}"
        )
    first_s = min(r.created_time for r in results)
    last_s = max(r.lifespan[1] for r in results)
    token_ids = [list(r.generated_tokens) for r in results]
    del model, outputs, results
    free_device_memory(device)
    return PeerResult(
        name="transformers",
        version=version,
        attn_implementation=attn,
        elapsed_s=last_s - first_s,
        wall_s=wall_s,
        num_output_tokens=sum(len(t) for t in token_ids),
        output_token_ids=token_ids,
    )


def free_device_memory(device: torch.device) -> None:
    """Collect garbage and give cached CUDA blocks back (so the next model fits)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
