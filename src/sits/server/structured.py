"""A request's structured-output fields -> one checked `StructuredOutputsParams`, or a 400.

Accepted, on `/v1/chat/completions` and `/v1/completions` alike (as vLLM accepts them):
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`
  (the schema is enforced whatever `strict` says);
- vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and its newer
  `structured_outputs` object (json, json_object, regex, choice, grammar, structural_tag,
  disable_any_whitespace).

Invariants: at most one of these may constrain a request (two are a 400 naming the second);
the spec is checked here (`sampling.grammar.check_structured_outputs`: schema, regex and
grammar errors found without the tokenizer), so an invalid one is a 400 naming the field the
client sent and never reaches the engine. vLLM options sits cannot honour (a
`guided_whitespace_pattern`, a backend other than xgrammar) are refused, not ignored; those it
honours by construction are accepted (`disable_additional_properties`: xgrammar's strict mode
already refuses properties a schema does not list; `disable_fallback`: there is no fallback).
"""

from __future__ import annotations

from typing import Any

from sits.core.errors import InvalidParameterError
from sits.core.structured_outputs import StructuredOutputsParams
from sits.sampling.grammar import check_structured_outputs
from sits.server.errors import unsupported
from sits.server.protocol import GuidedFields, StructuredOutputsBody

_BACKENDS = (None, "auto", "xgrammar")


def structured_outputs_of(req: GuidedFields) -> StructuredOutputsParams | None:
    """The request's one output constraint, checked; None when it has none.

    Raises:
        InvalidParameterError: an invalid schema, regex, grammar or choice list, or two
            constraints (`param` names the field).
        ServerError: 400 for an option sits does not implement.
    """
    if req.guided_whitespace_pattern is not None:
        raise unsupported(
            "guided_whitespace_pattern", "guided_whitespace_pattern is not supported."
        )
    if req.guided_decoding_backend not in _BACKENDS:
        raise unsupported(
            "guided_decoding_backend",
            f"guided_decoding_backend {req.guided_decoding_backend!r} is not supported; "
            "sits uses xgrammar.",
        )
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = _response_format_kwargs(req)
    if response_format is not None:
        found.append(response_format)
    guided = (
        ("guided_json", "json", req.guided_json),
        ("guided_regex", "regex", req.guided_regex),
        ("guided_choice", "choice", req.guided_choice),
        ("guided_grammar", "grammar", req.guided_grammar),
    )
    found.extend((param, {kind: value}) for param, kind, value in guided if value is not None)
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _body_kwargs(req.structured_outputs)))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidParameterError(
            found[1][0],
            f"only one output constraint may be set; got {', '.join(p for p, _ in found)}.",
        )
    param, kwargs = found[0]
    try:
        spec = StructuredOutputsParams(**kwargs)
    except InvalidParameterError as exc:
        raise InvalidParameterError(param, f"{param}: {exc}") from exc
    check_structured_outputs(spec, param)
    return spec


def _response_format_kwargs(req: GuidedFields) -> tuple[str, dict[str, Any]] | None:
    """(field, StructuredOutputsParams kwargs) of `response_format`; None for none or text."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "response_format", {"json_object": True}
    if fmt.type != "json_schema":
        raise InvalidParameterError(
            "response_format.type",
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
            f"{fmt.type!r}.",
        )
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidParameterError(
            "response_format.json_schema.schema",
            "response_format of type 'json_schema' needs json_schema.schema.",
        )
    return "response_format.json_schema.schema", {"json": fmt.json_schema.schema_}


def _body_kwargs(body: StructuredOutputsBody) -> dict[str, Any]:
    """StructuredOutputsParams kwargs of a `structured_outputs` object."""
    if body.whitespace_pattern is not None:
        raise unsupported(
            "structured_outputs.whitespace_pattern", "whitespace_pattern is not supported."
        )
    kwargs: dict[str, Any] = {
        "json": body.json_,
        "json_object": bool(body.json_object),
        "regex": body.regex,
        "choice": body.choice,
        "grammar": body.grammar,
        "structural_tag": body.structural_tag,
        "disable_any_whitespace": body.disable_any_whitespace,
    }
    return kwargs
