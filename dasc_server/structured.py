"""Structured output: OpenAI's ``response_format`` -> an llguidance grammar for rank 0's mask.

``{"type": "text"}`` (or none) constrains nothing; ``{"type": "json_object"}`` makes the output
one JSON object; ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` makes
it a JSON value the schema accepts.  The JSON is compact (``,`` and ``:`` without spaces, no
newlines) unless the schema's own ``x-guidance`` options say otherwise, so a small model cannot
spend its tokens on whitespace.  A schema llguidance cannot enforce (an unknown ``format``, a
keyword it does not implement) is a 400 naming ``response_format``, never a looser grammar.

Once the JSON is complete, rank 0 allows only EOS, so a request that ends with
``finish_reason: "stop"`` holds valid JSON; ``"length"`` means ``max_tokens`` cut it.
"""

from __future__ import annotations

from typing import Any

import llguidance

from dasc_server.request_errors import RequestError

COMPACT = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions
PARAM = "response_format"


def json_schema_grammar(schema: dict) -> str:
    """A JSON schema -> llguidance grammar (compact JSON unless the schema says otherwise)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)


def checked(grammar: str, param: str) -> str:
    """The grammar, or a 400 naming ``param`` with llguidance's reason."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise RequestError(f"{param}: the grammar cannot be enforced: {error}", param=param)
    return grammar


def response_format_grammar(response_format: Any) -> str:
    """``response_format`` -> grammar ("" for text or none); 400 for anything else."""
    if response_format is None:
        return ""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"),
                                                               str):
        raise RequestError("response_format must be an object with a type", param=PARAM)
    kind = response_format["type"]
    if kind == "text":
        return ""
    if kind == "json_object":
        return checked(json_schema_grammar({"type": "object"}), PARAM)
    if kind != "json_schema":
        raise RequestError(f"response_format type {kind!r} is not supported (text, "
                           "json_object, json_schema)", param=PARAM)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RequestError("response_format json_schema needs an object with a name",
                           param=PARAM)
    schema = spec.get("schema", True)  # OpenAI: absent means any JSON value
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise RequestError("response_format json_schema.schema must be a JSON schema object",
                           param=PARAM)
    try:
        grammar = json_schema_grammar(schema)
    except ValueError as e:
        raise RequestError(f"response_format: {e}", param=PARAM) from e
    return checked(grammar, PARAM)
