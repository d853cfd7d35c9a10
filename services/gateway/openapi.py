"""The OpenAPI description of every HTTP route, served at GET /openapi.json and written to
schemas/http/openapi.json by `radixflow schemas`. Request bodies are the msgspec structs the
handlers decode with, so the description cannot drift from what is accepted; a test checks that
ROUTES names exactly the routes the app serves."""
from __future__ import annotations

import json
import os

import msgspec

from . import protocol as P

# (method, path, tag, summary, request body struct or None)
ROUTES: tuple[tuple[str, str, str, str, type | None], ...] = (
    ("post", "/v1/completions", "openai", "Text completions (OpenAI); n, logprobs, echo, stream", P.CompletionBody),
    ("post", "/v1/chat/completions", "openai", "Chat completions (OpenAI); n, logprobs, stream", P.ChatBody),
    ("get", "/v1/models", "openai", "The served models", None),
    ("post", "/generate", "sglang", "SGLang-native generation: one prompt or a batch; prompt logprobs", P.GenerateBody),
    ("post", "/tokenize", "sglang", "Text (or chat messages) to token ids", P.TokenizeBody),
    ("post", "/detokenize", "sglang", "Token ids to text", P.DetokenizeBody),
    ("get", "/get_model_info", "sglang", "The served model", None),
    ("get", "/get_server_info", "sglang", "Version, executors, auth", None),
    ("get", "/server_info", "sglang", "The same (the name sglang.get_server_info() uses)", None),
    ("get", "/health_generate", "sglang", "200 after a one-token generation went through", None),
    ("post", "/abort_request", "sglang", "Abort the caller's own requests of these ids", P.AbortBody),
    ("post", "/v1/programs", "programs", "Run a program (a DAG of gen/select nodes)", P.ProgramBody),
    ("get", "/v1/programs/{id}", "programs", "A program's state and node results", None),
    ("delete", "/v1/programs/{id}", "programs", "Cancel a program", None),
    ("delete", "/v1/programs/{id}/nodes/{node}", "programs", "Cancel a node and its dependents", None),
    ("get", "/health", "operations", "200 when every service answers, a model is served and the grammar workers have started", None),
    ("get", "/metrics", "operations", "Prometheus text of every instance", None),
    ("get", "/v1/memory", "operations", "Realized KV and state memory of every executor", None),
    ("post", "/flush_cache", "operations", "Empty the caller's cached pages (all: admin)", P.FlushBody),
    ("get", "/flush_cache", "operations", "Empty the caller's cached pages", None),
    ("get", "/openapi.json", "operations", "This description", None),
)


ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": "integer"}}}}}


def spec() -> dict:
    bodies = [b for *_, b in ROUTES if b is not None]
    schemas, components = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    by_type = dict(zip(bodies, schemas))
    paths: dict[str, dict] = {}
    for method, path, tag, summary, body in ROUTES:
        op = {"tags": [tag], "summary": summary, "responses": {
            "200": {"description": "OK (SSE `text/event-stream` when the body asks to stream)"},
            "4XX": {"description": "error", "content": {"application/json": {"schema": ERROR}}},
            "5XX": {"description": "error", "content": {"application/json": {"schema": ERROR}}}}}
        params = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
        if body is not None:     # flush_cache takes an empty body as {} (ops.py)
            op["requestBody"] = {"required": method != "get" and body is not P.FlushBody,
                                 "content": {"application/json": {"schema": by_type[body]}}}
        if path not in ("/health", "/metrics", "/openapi.json", "/health_generate"):
            op["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0",
            "info": {"title": "radixflow", "version": "1",
                     "description": "OpenAI- and SGLang-compatible serving of LLM programs. Errors: OpenAI's shape."},
            "paths": paths,
            "components": {"schemas": components,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def render() -> str:
    return json.dumps(spec(), indent=2, sort_keys=True) + "\n"


def path_in(directory: str) -> str:
    return os.path.join(directory, "http", "openapi.json")
