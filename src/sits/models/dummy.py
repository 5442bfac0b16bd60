"""Dummy weights (`--load-format dummy`): seeded random parameters made directly on the device.

For benchmarks of real model shapes without downloading checkpoints (vLLM's "dummy" load
format). The values of one parameter depend only on (seed, parameter name, shape, dtype,
device): each parameter draws from its own `torch.Generator` seeded with a hash of the seed and
its name, so the order of initialisation does not matter and `dummy_tensor` rebuilds any
parameter exactly (the transformers peer of the benchmark gets the same weights this way).

Values: RMSNorm weights 1, biases 0, every other parameter N(0, DUMMY_STD^2). With std 0.02 a
unit-RMS input gives projections of RMS about 0.02 * sqrt(fan_in) (0.9 at width 2048), so each
layer adds O(1) to the residual stream (finite in bf16 through 48 layers).

Routing like a trained model's. With plain random weights the residual stream of every token
fills with the same direction (attention averages the values over the context), so from the
second layer on the router sends nearly every token to the same few experts: a 10-layer model
of the Qwen3-30B-A3B shape sent 430-512 of 512 random tokens to one expert in layers 1-9 (the
mean is 32), and its MoE benchmarks would read a few experts per layer where a trained,
load-balanced model reads most of them. So the first H / ROUTER_DIMS_DIVISOR dimensions of the
hidden state carry the token's embedding alone: the layers' output projections (attention
`o_proj`, the MLP's `down_proj`, the experts' `w2`) are zero in those rows, and the router
(`mlp.gate`) reads only those dimensions. Routing then depends on the token, and random
tokens spread over all experts in every layer (the same model: all 128 experts in every
layer, at most 56 tokens on one). Compute and bytes per step are unchanged.

A "dummy directory" holds a checkpoint's config.json and generation_config.json plus the marker
file DUMMY_MARKER ({"seed": S}); `load_model` with load_format "auto" makes dummy weights for
it. `prepare_dummy_dir` creates one (under the sits cache dir) for any checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import torch
from torch import Tensor, nn

from sits.config import sits_cache_dir

DUMMY_STD = 0.02
ROUTER_DIMS_DIVISOR = 8  # the router reads hidden dimensions [0, H // 8)
_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight", ".w2")  # rows over H: [..., H, in]
_ROUTERS = ("mlp.gate.weight",)  # [E, H]
DUMMY_MARKER = "sits_dummy_weights.json"
_COPIED_FILES = ("config.json", "generation_config.json")


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` under the model seed `seed` (63-bit, stable
    across processes and Python versions)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def fill_dummy_(param: Tensor, name: str, seed: int, std: float = DUMMY_STD) -> None:
    """Fill one parameter in place with its dummy values (see the module docstring).

    Args:
        param: the parameter's tensor (any shape, floating dtype, on its final device).
        name: its name in our model (e.g. "model.layers.0.self_attn.qkv_proj.weight").
        seed: the model seed.
        std: standard deviation of the normal draws.
    """
    with torch.no_grad():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            generator = torch.Generator(device=param.device)
            generator.manual_seed(parameter_seed(seed, name))
            param.normal_(0.0, std, generator=generator)
            _keep_router_dims_for_tokens_(param, name)


def _keep_router_dims_for_tokens_(param: Tensor, name: str) -> None:
    """Zero what ties routing to the token alone (module docstring, "Routing"): the rows of
    hidden dims [0, H // ROUTER_DIMS_DIVISOR) in a layer's output projection ([..., H, in]),
    the columns of the other dims in a router ([E, H])."""
    if name.endswith(_RESIDUAL_WRITERS) and param.dim() >= 2:
        param[..., : param.shape[-2] // ROUTER_DIMS_DIVISOR, :] = 0
    elif name.endswith(_ROUTERS) and param.dim() == 2:
        param[:, param.shape[-1] // ROUTER_DIMS_DIVISOR :] = 0


def dummy_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    std: float = DUMMY_STD,
) -> Tensor:
    """A new tensor equal to what `init_dummy_weights` writes into parameter `name`."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    fill_dummy_(tensor, name, seed, std)
    return tensor


def init_dummy_weights(model: nn.Module, seed: int, std: float = DUMMY_STD) -> None:
    """Fill every parameter of `model` in place with its dummy values (tied parameters once).

    The model must already be materialised on its device (e.g. `to_empty`); nothing is made on
    the CPU, so a 30B-parameter model initialises in well under a second on a GPU.
    """
    for name, param in model.named_parameters():  # tied parameters are listed once
        fill_dummy_(param.data, name, seed, std)


def read_dummy_seed(model_dir: str) -> int | None:
    """The seed of a dummy directory, or None when `model_dir` is not one."""
    path = os.path.join(model_dir, DUMMY_MARKER)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return int(json.load(f)["seed"])


def prepare_dummy_dir(model_dir: str, seed: int, cache_dir: str | None = None) -> str:
    """A dummy directory with `model_dir`'s config files and the marker for `seed`.

    Made once under `cache_dir` (default `sits_cache_dir()/dummy`) per (absolute model_dir,
    config contents, seed), written to a temporary name and renamed, so a crash never leaves a
    half-written directory. A directory that already is a dummy directory of `seed` is
    returned as is.

    Raises:
        FileNotFoundError: model_dir has no config.json.
    """
    if read_dummy_seed(model_dir) == seed:
        return model_dir
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        config_bytes = f.read()
    key = hashlib.sha256(
        os.path.abspath(model_dir).encode() + b"\0" + config_bytes + f"\0{seed}".encode()
    ).hexdigest()[:16]
    base = cache_dir or os.path.join(sits_cache_dir(), "dummy")
    final_dir = os.path.join(base, f"{os.path.basename(os.path.normpath(model_dir))}-{key}")
    if os.path.isfile(os.path.join(final_dir, DUMMY_MARKER)):
        return final_dir
    os.makedirs(base, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".dummy-", dir=base)
    for name in _COPIED_FILES:
        source = os.path.join(model_dir, name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(tmp_dir, name))
    with open(os.path.join(tmp_dir, DUMMY_MARKER), "w", encoding="utf-8") as f:
        json.dump({"seed": seed, "source": os.path.abspath(model_dir)}, f)
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir
