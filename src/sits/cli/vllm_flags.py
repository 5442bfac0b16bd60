"""`vllm serve`'s server flags that `sits serve` accepts with vLLM's meaning.

`add_vllm_server_args` declares them; the `*_arg` functions turn them into what the server
needs, each refusing a bad value with an `InvalidParameterError` naming the flag:
- `--served-model-name A B ...`: the first name is the one responses carry, every name is
  accepted as `model` and listed by /v1/models;
- `--chat-template FILE|TEMPLATE`: a file's contents, else the text itself when it looks like
  a Jinja template (as vLLM's `load_chat_template`);
- `--generation-config auto|vllm|DIR`: the sampling defaults of `generation_config.json` in the
  model's directory (auto, the default), in DIR, or none (vllm), read as vLLM reads them (only
  the values that differ from transformers' defaults);
- `--max-logprobs`, `--enable-log-requests` / `--disable-log-requests`, `--max-log-len`;
- `--uvicorn-log-level`, `--root-path`, `--ssl-keyfile` / `--ssl-certfile` / `--ssl-ca-certs`
  / `--ssl-cert-reqs` (uvicorn's HTTPS), and the CORS flags `--allowed-origins`,
  `--allowed-methods`, `--allowed-headers`, `--allow-credentials`. Unlike vLLM, sits sends no
  CORS headers unless one of these flags is given: a browser page of another origin cannot
  read a local server's answers by default.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import MAX_LOGPROBS

# generation_config.json keys -> the request fields they are defaults of (vLLM's list).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_CORS_FLAGS = ("allowed_origins", "allowed_methods", "allowed_headers")
_TEMPLATE_MARKS = ("{{", "{%", "{#", "\n")


def add_vllm_server_args(p: argparse.ArgumentParser) -> None:
    """Add the vLLM server flags (see the module docstring) to `sits serve`'s parser."""
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients use as `model`: responses carry the first, every one is accepted "
        "and listed by /v1/models (default: the model's path)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template, as a file or inline, instead of the tokenizer's own",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults of requests that leave them unset: auto (the default) reads "
        "the model's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty; max_new_tokens bounds max_tokens), DIR reads DIR's, vllm none",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"the most logprobs or top_logprobs a request may ask for, 0-{MAX_LOGPROBS} "
        f"(default {MAX_LOGPROBS})",
    )
    p.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log one line per generation request: id, tenant, prompt, sampling parameters "
        "(default off)",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log requests (the default; vLLM's older flag)",
    )
    p.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="the most prompt characters a logged request shows (default: all)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level (default: --log-level)",
    )
    p.add_argument(
        "--root-path",
        default="",
        help="the path prefix when sits runs behind a path-based reverse proxy (uvicorn's "
        "root_path)",
    )
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    p.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates to verify client certificates"
    )
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="whether client certificates are required (Python ssl's CERT_NONE 0, "
        "CERT_OPTIONAL 1, CERT_REQUIRED 2; default 0)",
    )
    for flag, what in (
        ("--allowed-origins", "origins"),
        ("--allowed-methods", "methods"),
        ("--allowed-headers", "request headers"),
    ):
        p.add_argument(
            flag,
            nargs="+",
            default=None,
            help=f"CORS: allowed {what}, as values or one JSON list (with any CORS flag the "
            "others default to ['*']; without any, no CORS headers)",
        )
    p.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)"
    )


def served_names_arg(args: argparse.Namespace) -> tuple[str | None, tuple[str, ...]]:
    """(the name responses carry or None for the default, the further accepted names)."""
    names = args.served_model_name or []
    return (names[0] if names else None), tuple(names[1:])


def chat_template_arg(value: str | None) -> str | None:
    """The chat template of `--chat-template`: a file's text, else the value itself when it
    looks like a template (it holds a Jinja mark or a newline); None without the flag.

    Raises:
        InvalidParameterError("chat_template"): an unreadable file, or a value that is
            neither a file nor a template (a mistyped path).
    """
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidParameterError(
                "chat_template", f"cannot read the chat template {value!r}: {exc}"
            ) from exc
    if not any(mark in value for mark in _TEMPLATE_MARKS):
        raise InvalidParameterError(
            "chat_template", f"{value!r} is neither a file nor a Jinja chat template"
        )
    return value


def max_logprobs_arg(value: int) -> int:
    """`--max-logprobs`, checked before the model loads.

    Raises:
        InvalidParameterError("max_logprobs"): outside [0, MAX_LOGPROBS].
    """
    if not 0 <= value <= MAX_LOGPROBS:
        raise InvalidParameterError(
            "max_logprobs",
            f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the most sits' sampler returns), "
            f"got {value}",
        )
    return value


def sampling_defaults_arg(value: str, model_dir: str) -> dict[str, float]:
    """The request defaults of `--generation-config` for checkpoint `model_dir`: {} for
    "vllm" or a directory without generation_config.json.

    Raises:
        InvalidParameterError("generation_config"): DIR is not a directory, or its file is
            not valid JSON.
    """
    if value == "vllm":
        return {}
    folder = model_dir if value == "auto" else value
    if not os.path.isdir(folder):
        raise InvalidParameterError(
            "generation_config", f"--generation-config {value!r} is not a directory"
        )
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise InvalidParameterError(
            "generation_config", f"cannot read {folder}/generation_config.json: {exc}"
        ) from exc
    return {
        field: diff[key]
        for key, field in GENERATION_CONFIG_FIELDS.items()
        if diff.get(key) is not None
    }


def cors_arg(args: argparse.Namespace) -> Any:
    """The `CorsSettings` of the CORS flags; None when none is given.

    Raises:
        InvalidParameterError: a value that starts like a JSON list but is not one.
    """
    from sits.server.context import CorsSettings

    given = {flag: getattr(args, flag) for flag in _CORS_FLAGS if getattr(args, flag)}
    if not given and not args.allow_credentials:
        return None
    lists = {flag: _flag_list(flag, values) for flag, values in given.items()}
    return CorsSettings(**lists, allow_credentials=args.allow_credentials)


def _flag_list(flag: str, values: list[str]) -> tuple[str, ...]:
    """The values of a list flag, each either a plain value or a JSON list of them."""
    out: list[str] = []
    for value in values:
        if not value.lstrip().startswith("["):
            out.append(value)
            continue
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidParameterError(flag, f"not a JSON list: {value!r} ({exc})") from exc
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise InvalidParameterError(flag, f"not a JSON list of strings: {value!r}")
        out.extend(items)
    return tuple(out)


def uvicorn_kwargs_arg(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's options of `--root-path` and the --ssl-* flags (HTTPS with a certificate).

    Raises:
        InvalidParameterError: only one of --ssl-keyfile and --ssl-certfile, or a file that
            does not exist.
    """
    kwargs: dict[str, Any] = {"root_path": args.root_path} if args.root_path else {}
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        return kwargs
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if flag != "ssl_ca_certs" and path is None:
            raise InvalidParameterError(flag, "HTTPS needs both --ssl-keyfile and --ssl-certfile")
        if path is not None and not os.path.isfile(path):
            raise InvalidParameterError(flag, f"no such file: {path!r}")
    return {
        **kwargs,
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }
