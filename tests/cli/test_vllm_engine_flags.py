"""vLLM's engine flags with vLLM's meaning (issue 29): --dtype half/float, --kv-cache-dtype
fp8_e4m3, --swap-space (and its deprecated alias --cpu-offload-gb), --revision and
--download-dir, --trust-remote-code and --enable-chunked-prefill."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, ModelNotFoundError
from sits.core.sampling_params import SamplingParams
from sits.engine.arg_utils import add_engine_args, engine_kwargs
from sits.models.loader import resolve_model_path
from sits.runner.model_info import read_model_info


def _config(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    return EngineConfig(**engine_kwargs(parser.parse_args(["--model", "m", *flags])))


@pytest.mark.parametrize(
    ("flag", "dtype"),
    [("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"), ("float", "float32"),
     ("float32", "float32"), ("auto", "auto")],
)  # fmt: skip
def test_dtype_names(flag: str, dtype: str) -> None:
    assert _config("--dtype", flag).dtype == dtype


def test_dtype_half_loads_float16_weights(tiny_model_factory) -> None:
    model_dir = str(tiny_model_factory("qwen3"))
    info = read_model_info(EngineConfig(model=model_dir, dtype="half", device="cpu"), model_dir)
    assert info.dtype == torch.float16


def test_kv_cache_dtype_fp8_e4m3_is_fp8(tiny_model_factory) -> None:
    from sits.engine.llm import LLM

    assert _config("--kv-cache-dtype", "fp8_e4m3").kv_cache_dtype == "fp8"
    with pytest.raises(InvalidParameterError, match="fp8_e5m2 is not supported"):
        _config("--kv-cache-dtype", "fp8_e5m2")
    model_dir = str(tiny_model_factory("qwen3"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name in ("fp8", "fp8_e4m3"):
        llm = LLM(model=model_dir, dtype="float32", max_model_len=128, kv_cache_dtype=name)
        assert llm.engine_core.runner.kv_cache_dtype == "fp8"  # float8_e4m3fn, per-head scales
        outs[name] = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)[0]
    assert outs["fp8"].outputs[0].token_ids == outs["fp8_e4m3"].outputs[0].token_ids


def test_swap_space_and_its_deprecated_alias(caplog) -> None:
    assert _config().swap_space == 0
    assert _config("--swap-space", "2.5").swap_space == 2.5
    with caplog.at_level(logging.WARNING, logger="sits.engine.arg_utils"):
        assert _config("--cpu-offload-gb", "1.5").swap_space == 1.5
    assert "--cpu-offload-gb is deprecated: use --swap-space" in caplog.text
    assert _config("--swap-space", "2", "--cpu-offload-gb", "2").swap_space == 2
    with pytest.raises(InvalidParameterError) as err:
        _config("--swap-space", "2", "--cpu-offload-gb", "3")
    assert err.value.param == "swap_space"


def test_trust_remote_code_is_accepted_and_says_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="sits.engine.arg_utils"):
        config = _config("--trust-remote-code")
    assert config == _config()
    assert "sits runs no code from a checkpoint" in caplog.text


def test_chunked_prefill_is_always_on() -> None:
    assert _config("--enable-chunked-prefill") == _config()
    with pytest.raises(InvalidParameterError) as err:
        _config("--no-enable-chunked-prefill")
    assert err.value.param == "enable_chunked_prefill"


def _fake_hub_cache(root: Path) -> dict[str, Path]:
    """A Hugging Face cache holding org/tiny at two commits: main and tag v1."""
    repo = root / "models--org--tiny"
    snapshots = {}
    for ref, commit in (("main", "a" * 40), ("v1", "b" * 40)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(f'{{"ref": "{ref}"}}')
        snapshots[ref] = snapshot
    return snapshots


def test_revision_and_download_dir_pick_the_snapshot(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshots = _fake_hub_cache(tmp_path / "cache")
    cache = str(tmp_path / "cache")
    assert Path(resolve_model_path("org/tiny", download_dir=cache)) == snapshots["main"]
    got = resolve_model_path("org/tiny", revision="v1", download_dir=cache)
    assert Path(got) == snapshots["v1"]
    config = _config("--revision", "v1", "--download-dir", cache)
    assert config.hub_options == {"revision": "v1", "download_dir": cache}
    with pytest.raises(ModelNotFoundError, match="at revision 'v2'"):
        resolve_model_path("org/tiny", revision="v2", download_dir=cache)
