"""`StructuredOutputsParams`: the constraint a request's output must match (vLLM's names).

A request may carry one constraint: a JSON schema (`json`), any JSON object (`json_object`), a
regular expression (`regex`), one of a list of strings (`choice`), an EBNF/GBNF grammar
(`grammar`, as xgrammar reads it), or an xgrammar structural tag (`structural_tag`, the JSON
text of one: tool calling builds these). The names follow vLLM's `StructuredOutputsParams`
(its older `GuidedDecodingParams` used the same ones).

Invariants: the object is frozen and holds only strings, tuples and booleans, so it pickles
(the engine may run in its own process) and hashes; `key` is the same for two requests whose
grammars are the same, so a compiled grammar is cached by it. A JSON schema given as a dict
is kept as its compact JSON text with the properties in the user's order (the order the
output writes them in). Exactly one kind is set, else `InvalidParameterError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sits.core.errors import InvalidParameterError

PARAM = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One request's output constraint; exactly one of the kinds is set.

    Attributes:
        json: a JSON schema, as JSON text (a dict or a JSON-schema bool is turned into it).
        json_object: any JSON object (xgrammar's builtin JSON grammar, an object at the top).
        regex: the output fully matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's GBNF dialect: `root ::= ...`).
        structural_tag: an xgrammar structural tag, as JSON text.
        disable_any_whitespace: JSON kinds write no whitespace between tokens (vLLM's flag).

    Raises:
        InvalidParameterError: no kind or several, or a value of the wrong type
            ("structured_outputs").
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", schema_text(self.json))
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            object.__setattr__(self, "structural_tag", schema_text(self.structural_tag))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, list | tuple):
                raise InvalidParameterError(PARAM, "choice must be a list of strings.")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise InvalidParameterError(PARAM, "choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidParameterError(PARAM, f"{name} must be a string, got {value!r}.")
        kinds = self.kinds_set()
        if len(kinds) != 1:
            raise InvalidParameterError(
                PARAM,
                "exactly one of json, json_object, regex, choice, grammar and structural_tag "
                f"must be set, got {', '.join(kinds) if kinds else 'none'}.",
            )

    def kinds_set(self) -> list[str]:
        """The kinds that are set (one, once constructed)."""
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one kind that is set: one of `KINDS`."""
        return self.kinds_set()[0]

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, its text, disable_any_whitespace): equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "choice":
            text = json.dumps(list(value))
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, self.disable_any_whitespace


def schema_text(schema: Any) -> str:
    """A JSON value (a schema dict, a bool schema) as compact JSON text, keys in their order.

    Raises:
        InvalidParameterError: the value is not JSON ("structured_outputs").
    """
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(PARAM, f"the JSON schema is not JSON: {exc}") from exc
