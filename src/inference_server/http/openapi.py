"""``GET /openapi.json``: an OpenAPI 3.1 document generated from the app's route list and the attrs records
the routes parse their bodies into (``http/schemas.py``), so the schema cannot drift from validation.

The generator maps annotations to JSON Schema (2020-12, as OpenAPI 3.1 uses): ``int`` -> a 64-bit
``integer``, ``float`` -> ``number``, ``bool``, ``str``, ``Any`` -> any value, ``X | None`` -> ``anyOf``
with ``null``, ``list[T]`` -> ``array``, ``dict[str, T]`` -> ``object`` of ``T``, and an attrs record ->
a ``$ref`` to a component (``additionalProperties: false``, as the converter forbids unknown fields; the
fields without a default are ``required``). Value ranges are checked by the engine's admission and are
not repeated here; every route documents the OpenAI-shaped error responses it can give.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from inference_server.http.body_parser import INT_RANGE

ERROR_STATUSES: dict[str, str] = {
    "400": "invalid request: the error's param names the field",
    "404": "unknown route or model",
    "405": "method not allowed",
    "408": "the request body did not arrive in time",
    "413": "the request body is too large",
    "429": "overloaded: retry after the Retry-After header's seconds",
    "500": "internal error",
    "503": "starting, draining or failed",
}
"""Error statuses a route with a JSON body can answer; routes without one answer the last five."""

_PATH_PARAM = re.compile(r"<(?:[a-z]+:)?([A-Za-z_]\w*)>")


class RouteLike(Protocol):
    """What the generator reads of ``app.Route``."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def summary(self) -> str: ...

    @property
    def body(self) -> type | None: ...

    @property
    def query(self) -> tuple[str, ...]: ...

    @property
    def content_type(self) -> str: ...


def openapi_path(path: str) -> str:
    """A Quart rule (``/v1/models/<path:model>``) as an OpenAPI path (``/v1/models/{model}``)."""
    return _PATH_PARAM.sub(r"{\1}", path)


class SchemaBuilder:
    """JSON Schemas of annotations; attrs records are collected as named components."""

    def __init__(self) -> None:
        self.components: dict[str, dict[str, Any]] = {}

    def schema(self, annotation: Any) -> dict[str, Any]:
        """The JSON Schema of one annotation (raises ``TypeError`` for one it does not know)."""
        if annotation is Any:
            return {}
        if annotation is type(None) or annotation is None:
            return {"type": "null"}
        if annotation is bool:
            return {"type": "boolean"}
        if annotation is int:
            return {"type": "integer", "minimum": INT_RANGE[0], "maximum": INT_RANGE[1] - 1}
        if annotation is float:
            return {"type": "number"}
        if annotation is str:
            return {"type": "string"}
        if isinstance(annotation, type) and attrs.has(annotation):
            return self._record(annotation)
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin in (typing.Union, types.UnionType):
            return {"anyOf": [self.schema(arg) for arg in args]}
        if origin is list:
            return {"type": "array", "items": self.schema(args[0])}
        if origin is dict and args[0] is str:
            return {"type": "object", "additionalProperties": self.schema(args[1])}
        raise TypeError(f"no JSON Schema for {annotation!r}")

    def _record(self, record: type) -> dict[str, Any]:
        name = record.__name__
        if name not in self.components:
            self.components[name] = {}  # placeholder: a record may refer to itself
            hints = typing.get_type_hints(record)
            fields = attrs.fields(record)
            properties = {field.name: self.schema(hints[field.name]) for field in fields}
            required = [field.name for field in fields if field.default is attrs.NOTHING]
            doc = (record.__doc__ or "").strip().split("\n\n")[0]
            component: dict[str, Any] = {"type": "object", "properties": properties,
                                         "additionalProperties": False}
            if required:
                component["required"] = required
            if doc:
                component["description"] = doc
            self.components[name] = component
        return {"$ref": f"#/components/schemas/{name}"}


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def _operation(route: RouteLike, builder: SchemaBuilder) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": route.summary,
                                 "operationId": f"{route.method.lower()}_{_identifier(route.path)}"}
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in _PATH_PARAM.findall(route.path)]
    parameters += [{"name": name, "in": "query", "required": False, "schema": {"type": "string"}}
                   for name in route.query]
    if parameters:
        operation["parameters"] = parameters
    ok_schema: dict[str, Any] = {} if route.content_type == "application/json" else {"type": "string"}
    ok: dict[str, Any] = {"description": "success", "content": {route.content_type: {"schema": ok_schema}}}
    statuses = list(ERROR_STATUSES)
    if route.body is not None:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": builder.schema(route.body)}}}
        if "stream" in attrs.fields_dict(route.body):
            ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    else:
        statuses = ["404", "405", "500", "503"]
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    operation["responses"] = {"200": ok, **{s: {"description": ERROR_STATUSES[s], **error} for s in statuses}}
    return operation


def _identifier(path: str) -> str:
    return re.sub(r"\W+", "_", openapi_path(path)).strip("_") or "index"


def openapi_document(routes: Sequence[RouteLike], *, title: str, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes``."""
    builder = SchemaBuilder()
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(openapi_path(route.path), {})[route.method.lower()] = _operation(route, builder)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": {**builder.components, "Error": ERROR_SCHEMA}},
    }
