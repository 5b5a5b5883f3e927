# %% [markdown]
# # The OpenAI-compatible server: the published schema
#
# > The OpenAPI 3.1 document `GET /openapi.json` serves: the routes, every request field with its limits, the replies and the errors.

# %% [markdown]
# A client generator turns this document into a typed client, and an API fuzzer turns it into
# requests: `tests/test_server_hostile.py` runs `schemathesis` against a real server with it,
# so every request the schema allows must get a well-formed reply and every one it forbids a
# 400, never a 500. The document is written by hand rather than derived from the handlers:
# they read raw JSON so that every refusal has OpenAI's shape (chapter 11), and a derived schema
# would describe what FastAPI parses, not what the server accepts.
#
# So the limits it states are not numbers of its own: they are the constants of chapter 11's
# checks (`MAX_STOPS`, `MAX_STOP_CHARS`, `MAX_LOGIT_BIAS`, `MAX_CHOICES`, `SEED_RANGE`, the body's
# size and depth), imported from `forge_engine.server.protocol`, and the test at the end checks
# that each field it names is one those checks know. What a schema cannot say (the prompt and
# `max_tokens` must fit the context together; stop token ids and logit bias keys must be in the
# vocabulary) is said in the descriptions, and those requests get a 400. The app (chapter 11c)
# serves it with the model's name, vocabulary and context filled in.

# %%
#| default_exp server.openapi

# %%
#| export
# Why one module of ~500 lines: most of it is one table, the request schema field by field with
# its limits, the mirror of chapter 11's checks; the test below holds the two to each other.
from __future__ import annotations

from forge_engine.server.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_CHOICES,
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    NO_EFFECT,
    SEED_RANGE,
)
from forge_engine.tool_calls import MAX_TOOLS

# %%
#| hide
from forge_engine.server.protocol import KNOWN_FIELDS


# %%
#| export
def _nullable(schema: dict) -> dict:
    "`schema`, or JSON null (which means: absent)."
    if "type" in schema:
        return {**schema, "type": [schema["type"], "null"]}
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {"anyOf": [schema, {"type": "null"}]}


def _error_response(description: str) -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _request_schema(kind: str, vocab_size: int | None, max_model_len: int | None) -> dict:
    "The JSON schema of a chat (`kind='chat'`) or text completion request body."
    number = lambda **kw: _nullable({"type": "number", **kw})
    integer = lambda **kw: _nullable({"type": "integer", **kw})
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    vocab = f" in [0, {vocab_size})" if vocab_size else " in the vocabulary"
    context = f" ({max_model_len} tokens)" if max_model_len else ""
    props = {
        "model": _nullable(
            {"type": "string", "description": "the served model's id (GET /v1/models); default: it"}
        ),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable(
            {"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})}}
        ),
        "max_tokens": integer(
            minimum=1,
            description=f"prompt + max_tokens must fit the context{context}; default: "
            + ("the rest of the context" if kind == "chat" else "16"),
        ),
        "max_completion_tokens": integer(minimum=1, description="the same as max_tokens"),
        "temperature": number(minimum=0, description="0: greedy"),
        "top_p": number(exclusiveMinimum=0, maximum=1),
        "top_k": integer(minimum=-1, description="-1 or 0: off"),
        "min_p": number(minimum=0, maximum=1),
        "presence_penalty": number(minimum=-2, maximum=2),
        "frequency_penalty": number(minimum=-2, maximum=2),
        "repetition_penalty": number(exclusiveMinimum=0),
        "seed": integer(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1] - 1),
        "stop": _nullable(
            {"anyOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": MAX_STOPS}]}
        ),
        "stop_token_ids": _nullable(
            {
                "type": "array",
                "maxItems": MAX_STOP_TOKEN_IDS,
                "items": {"type": "integer", "minimum": 0},
                "description": f"token ids{vocab}",
            }
        ),
        "logit_bias": _nullable(
            {
                "type": "object",
                "maxProperties": MAX_LOGIT_BIAS,
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                "description": f"token id (as a string){vocab} -> bias",
            }
        ),
        "ignore_eos": _nullable({"type": "boolean"}),
        "min_tokens": integer(minimum=0, description="at most max_tokens"),
        "n": integer(minimum=1, maximum=MAX_CHOICES),
        "guided_json": _nullable(
            {"type": "object", "description": "a JSON schema the output follows (vLLM's name)"}
        ),
        "guided_regex": _nullable(
            {"type": "string", "minLength": 1, "description": "a regex the output matches"}
        ),
        "guided_choice": _nullable(
            {
                "type": "array",
                "minItems": 1,
                "items": {"type": "string", "minLength": 1},
                "description": "the output is one of these",
            }
        ),
        "guided_grammar": _nullable(
            {"type": "string", "minLength": 1, "description": "a Lark grammar"}
        ),
        **{
            name: _nullable({"type": {str: "string", bool: "boolean", dict: "object"}[t]})
            for name, t in NO_EFFECT.items()
        },
    }
    if kind == "chat":
        part = {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        }
        content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
        said = lambda roles: {  # a message of one of these roles: its text, required
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"enum": roles}, "content": content, "name": {"type": "string"}},
        }
        message = {
            "anyOf": [
                said(["system", "developer", "user"]),
                {
                    **said(["tool"]),
                    "properties": {
                        **said(["tool"])["properties"],
                        "tool_call_id": {"type": "string"},
                    },
                },
                {  # an assistant's turn: its text, or tool calls with or without text
                    "type": "object",
                    "required": ["role"],
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {"anyOf": [*content["anyOf"], {"type": "null"}]},
                        "tool_calls": {"type": "array", "minItems": 1, "items": TOOL_CALL_SCHEMA},
                    },
                    "anyOf": [{"required": ["content"]}, {"required": ["tool_calls"]}],
                },
            ]
        }
        props.update(
            {
                "messages": {"type": "array", "minItems": 1, "items": message},
                "logprobs": _nullable({"type": "boolean"}),
                "top_logprobs": integer(minimum=0, maximum=20, description="needs logprobs: true"),
                "response_format": _nullable(
                    {
                        "oneOf": [
                            {
                                "type": "object",
                                "required": ["type"],
                                "properties": {"type": {"enum": ["text", "json_object"]}},
                            },
                            {
                                "type": "object",
                                "required": ["type", "json_schema"],
                                "properties": {
                                    "type": {"const": "json_schema"},
                                    "json_schema": {
                                        "type": "object",
                                        "required": ["name"],
                                        "properties": {
                                            "name": {
                                                "type": "string",
                                                "pattern": "^[A-Za-z0-9_-]{1,64}$",
                                            },
                                            "description": {"type": "string"},
                                            "schema": {"type": "object"},
                                            "strict": _nullable({"type": "boolean"}),
                                        },
                                    },
                                },
                            },
                        ]
                    }
                ),
                "tools": _nullable(
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_TOOLS,
                        "items": {
                            "type": "object",
                            "required": ["type", "function"],
                            "properties": {
                                "type": {"const": "function"},
                                "function": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {
                                        "name": {
                                            "type": "string",
                                            "pattern": "^[A-Za-z0-9_-]{1,64}$",
                                        },
                                        "description": {"type": "string"},
                                        "parameters": {"type": "object"},
                                        "strict": _nullable({"type": "boolean"}),
                                    },
                                },
                            },
                        },
                    }
                ),
                "tool_choice": _nullable(
                    {
                        "anyOf": [
                            {"enum": ["none", "auto", "required"]},
                            {
                                "type": "object",
                                "required": ["type", "function"],
                                "properties": {
                                    "type": {"const": "function"},
                                    "function": {
                                        "type": "object",
                                        "required": ["name"],
                                        "properties": {"name": {"type": "string"}},
                                    },
                                },
                            },
                        ],
                        "description": "needs tools (but 'none')",
                    }
                ),
                "parallel_tool_calls": _nullable({"type": "boolean"}),
                "functions": _nullable({"type": "array", "maxItems": 0}),
                "function_call": _nullable({"const": "none"}),
                "modalities": _nullable(
                    {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}
                ),
            }
        )
    else:
        props.update(
            {
                "prompt": {
                    "anyOf": [
                        {"type": "string", "minLength": 1},
                        {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "integer", "minimum": 0},
                            "description": f"token ids{vocab}",
                        },
                    ]
                },
                "logprobs": integer(minimum=0, maximum=20),
                "echo": _nullable({"const": False}),
                "suffix": _nullable({"const": ""}),
                "best_of": integer(minimum=1, maximum=1),
            }
        )
    required = ["messages"] if kind == "chat" else ["prompt"]
    return {
        "type": "object",
        "required": required,
        "properties": props,
        "additionalProperties": False,
        **({"dependentRequired": {"tool_choice": ["tools"]}} if kind == "chat" else {}),
    }


TOOL_CALL_SCHEMA = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "JSON"},
            },
        },
    },
}


def _reply_schema(kind: str) -> dict:
    "The JSON schema of a whole (not streamed) reply."
    logprobs = {"type": ["object", "null"]}
    if kind == "chat":
        choice = {
            "index": {"type": "integer"},
            "logprobs": logprobs,
            "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"]},
                    "tool_calls": {"type": "array", "items": TOOL_CALL_SCHEMA},
                },
            },
        }
    else:
        choice = {
            "index": {"type": "integer"},
            "logprobs": logprobs,
            "finish_reason": {"enum": ["stop", "length"]},
            "text": {"type": "string"},
        }
    usage = {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            k: {"type": "integer", "minimum": 0}
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
    }
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion" if kind == "chat" else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "usage": usage,
            "choices": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {"type": "object", "required": list(choice), "properties": choice},
            },
        },
    }


def openapi_schema(
    model_name: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    api_key: bool = False,
) -> dict:
    """The OpenAPI 3.1 description of this server: the routes, the request fields with their
    limits, the replies."""
    errors = {
        "400": _error_response("a field is wrong: `param` names it"),
        "403": _error_response("a web page's request, or a foreign Host header (no API key set)"),
        "404": _error_response("no such model"),
        "413": _error_response(f"the body is over {max_body_bytes} bytes"),
        "415": _error_response("the body is not sent as application/json (no API key set)"),
        "429": _error_response("the waiting queue is full: retry after Retry-After seconds"),
        "503": _error_response(
            "the model is loading, the engine stopped, or the server is shutting down"
        ),
    }
    if api_key:
        errors["401"] = _error_response("missing or wrong API key")

    def completion(kind: str, summary: str) -> dict:
        return {
            "post": {
                "summary": summary,
                "operationId": f"create_{kind}_completion",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": _request_schema(kind, vocab_size, max_model_len)
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": "the reply, whole or (stream: true) as server-sent events",
                        "content": {
                            "application/json": {"schema": _reply_schema(kind)},
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **errors,
                },
            }
        }

    model_card = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    }
    listing = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model_card}},
    }
    json_reply = lambda schema, description="OK": {
        "description": description,
        "content": {"application/json": {"schema": schema}},
    }
    v1_errors = {k: v for k, v in errors.items() if k in ("401", "403", "503")}
    schema = {
        "openapi": "3.1.0",
        "info": {
            "title": "forge-engine",
            "version": "1",
            "description": f"An OpenAI-compatible server for {model_name!r}: chat and text "
            "completions (one choice; tools, structured outputs), streamed or whole. Request "
            f"bodies: at most {max_body_bytes} bytes, "
            f"{MAX_JSON_DEPTH} levels deep.",
        },
        "paths": {
            "/v1/chat/completions": completion("chat", "a chat completion"),
            "/v1/completions": completion("text", "a text completion"),
            "/v1/models": {
                "get": {
                    "summary": "the served model",
                    "operationId": "list_models",
                    "responses": {"200": json_reply(listing), **v1_errors},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "one model",
                    "operationId": "retrieve_model",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {"200": json_reply(model_card), "404": errors["404"], **v1_errors},
                }
            },
            "/v1/engine/stats": {
                "get": {
                    "summary": "the engine's live numbers (the chat page's panel)",
                    "operationId": "engine_stats",
                    "responses": {"200": json_reply({"type": "object"}), **v1_errors},
                }
            },
            "/health": {
                "get": {
                    "summary": "200 once the model is loaded and warmed up",
                    "operationId": "health",
                    "responses": {
                        "200": json_reply({"type": "object", "required": ["status"]}),
                        "503": json_reply(
                            {"type": "object", "required": ["status"]}, "loading, or unavailable"
                        ),
                        "403": errors["403"],
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "operationId": "metrics",
                    "responses": {
                        "200": {
                            "description": "the text format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        "403": errors["403"],
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "null"]},
                            },
                        }
                    },
                }
            }
        },
    }
    if api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in schema["paths"].items():
            if path.startswith("/v1/"):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return schema


# %%
spec = openapi_schema("qwen3-tiny", vocab_size=500, max_model_len=100)
chat_body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
    "application/json"
]["schema"]
assert (
    chat_body["properties"]["stop"]["anyOf"][1]["maxItems"] == MAX_STOPS
    and chat_body["additionalProperties"] is False
)
assert set(chat_body["properties"]) <= KNOWN_FIELDS["chat"]
text_body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"][
    "schema"
]
assert (
    set(text_body["properties"]) <= KNOWN_FIELDS["text"]
    and "401" not in spec["paths"]["/v1/models"]["get"]["responses"]
)
assert openapi_schema("m", api_key=True)["paths"]["/v1/models"]["get"]["security"] == [
    {"bearer": []}
]
