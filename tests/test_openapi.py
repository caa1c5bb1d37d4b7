"""The OpenAPI document (service/openapi.yaml, copied to docs/openapi.yaml) cannot drift from the
code: its paths are the registered routes, its request schemas are the msgspec body schemas, its
query parameters are the ones the handlers take, its problem types are the service's errors, and
the envelope of every state validates against it. tests/test_schemathesis.py fuzzes the rest."""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import schemathesis
import yaml

from service import bodies, errors
from service.http import problems
from service.http.app import create_app
from service.http.openapi import DOCUMENT_JSON, load_document
from service.http.routes import QUERY, ROUTES
from service.settings import MEMORY_URL
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings

ROOT = Path(__file__).resolve().parent.parent
SPEC = load_document()
METHODS = ("get", "put", "post", "delete", "patch")
# Registered routes that are not part of the API: the web inbox's HTML page and its static files.
NOT_IN_SPEC = {("GET", "/"), ("GET", "/web/{name}")}
BODY_SCHEMAS = {
    "Ask": bodies.Ask,
    "Answer": bodies.Answer,
    "Cancel": bodies.Cancel,
    "WaitMany": bodies.WaitMany,
    "NewPrincipal": bodies.NewPrincipal,
    "NewToken": bodies.NewToken,
    "RoomMembers": bodies.RoomMembers,
    "NewWebhook": bodies.NewWebhook,
    "NewChannel": bodies.NewChannel,
}
CONSTRAINTS = (
    "type", "minLength", "maxLength", "minItems", "maxItems", "minimum", "maximum", "pattern",
    "enum", "const", "additionalProperties",
)  # fmt: skip


def spec_operations() -> set[tuple[str, str]]:
    return {
        (method.upper(), path) for path, item in SPEC["paths"].items() for method in item if method in METHODS
    }


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    """A `{"$ref": "#/components/..."}` node replaced by what it names."""
    if "$ref" not in node:
        return node
    target: Any = SPEC
    for part in node["$ref"].removeprefix("#/").split("/"):
        target = target[part]
    return resolve(target)


def validator(schema_name: str) -> jsonschema.Draft202012Validator:
    """A validator for one component schema, its $refs resolved inside the document."""
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": SPEC["components"]}
    return jsonschema.Draft202012Validator(root, format_checker=jsonschema.FormatChecker())


def test_docs_copy_is_identical_to_the_packaged_document() -> None:
    packaged = (ROOT / "service" / "openapi.yaml").read_text()
    assert (ROOT / "docs" / "openapi.yaml").read_text() == packaged, (
        "docs/openapi.yaml differs: cp service/openapi.yaml docs/openapi.yaml"
    )


def test_document_version_is_the_package_version() -> None:
    assert SPEC["info"]["version"] == importlib.metadata.version("question-service")


def test_document_is_valid_openapi_3_1_and_every_schema_is_valid_json_schema() -> None:
    assert SPEC["openapi"].startswith("3.1.")
    schemathesis.openapi.from_dict(json.loads(DOCUMENT_JSON)).validate()
    for name, schema in SPEC["components"]["schemas"].items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            pytest.fail(f"components.schemas.{name}: {exc.message}")


def test_every_reference_resolves() -> None:
    text = json.dumps(SPEC)
    for ref in set(re.findall(r'"\$ref": "#/([^"]+)"', text)):
        node: Any = SPEC
        for part in ref.split("/"):
            assert part in node, f"#/{ref} does not resolve"
            node = node[part]


def test_document_paths_and_methods_are_the_registered_routes() -> None:
    app = create_app(test_settings(MEMORY_URL))
    registered = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"  # aiohttp adds HEAD to every GET
    }
    assert registered >= NOT_IN_SPEC, "the exclusion list names a route that no longer exists"
    assert registered - NOT_IN_SPEC == spec_operations()


def needs_token(path: str) -> bool:
    """As service.http.routes.auth_middleware decides: /v1, except a Ping's signed action link."""
    return path.startswith("/v1/") and not path.startswith("/v1/actions/")


def test_every_operation_documents_401_exactly_when_it_needs_a_token() -> None:
    for path, item in SPEC["paths"].items():
        for method, operation in item.items():
            if method not in METHODS:
                continue
            public = operation.get("security") == []
            assert public == (not needs_token(path)), f"{method} {path}: security"
            assert ("401" in operation["responses"]) == needs_token(path), f"{method} {path}: 401"
            if path.startswith("/v1/"):
                # A /v1 route refuses unknown query parameters, and every one reads Redis.
                assert {"422", "503"} <= set(operation["responses"]), f"{method} {path}"


def test_query_parameters_are_the_ones_each_handler_takes() -> None:
    handler_of = {(route.method, route.path): route.handler for route in ROUTES}
    for method, path in spec_operations():
        item = SPEC["paths"][path]
        parameters = [*item.get("parameters", []), *item[method.lower()].get("parameters", [])]
        resolved = [resolve(p) for p in parameters]
        documented = {p["name"] for p in resolved if p["in"] == "query"}
        taken = QUERY.get(handler_of[(method, path)], frozenset())
        assert documented == taken, f"{method} {path}"


def constraints(schema: Any, defs: dict[str, Any], path: str = "$") -> Iterator[tuple[str, str, str]]:
    """(path, keyword, value) for every constraint in a schema, $refs resolved and the
    alternatives of a value (anyOf/oneOf/allOf) flattened. An object's own oneOf is a rule across
    its fields (exactly one of `user` and `room`), which msgspec checks in code: not compared."""
    if "$ref" in schema:
        yield from constraints(defs[schema["$ref"].rsplit("/", 1)[1]], defs, path)
        return
    for keyword in CONSTRAINTS:
        if keyword in schema:
            value = schema[keyword]
            if keyword == "pattern":
                value = re.sub(r"\\Z$", "$", value)  # Python's end anchor; JSON Schema has $
            if keyword == "enum":
                value = sorted(value)
            if (keyword == "additionalProperties" and value is True) or (
                keyword == "type" and "enum" in schema
            ):
                continue
            yield path, keyword, json.dumps(value, sort_keys=True)
    if schema.get("required"):
        yield path, "required", json.dumps(sorted(schema["required"]))
    for name, sub in schema.get("properties", {}).items():
        yield from constraints(sub, defs, f"{path}.{name}")
    if "items" in schema:
        yield from constraints(schema["items"], defs, f"{path}[]")
    for combinator in ("anyOf", "oneOf", "allOf"):
        if combinator == "oneOf" and "properties" in schema:
            continue
        for sub in schema.get(combinator, []):
            yield from constraints(sub, defs, path)


@pytest.mark.parametrize("name", sorted(BODY_SCHEMAS))
def test_request_body_schema_has_the_fields_and_limits_of_the_msgspec_schema(name: str) -> None:
    generated = msgspec.json.schema(BODY_SCHEMAS[name])
    from_code = set(constraints(generated, generated["$defs"]))
    from_spec = set(constraints(SPEC["components"]["schemas"][name], SPEC["components"]["schemas"]))
    assert from_spec == from_code


def test_every_body_route_documents_the_body_errors() -> None:
    for path, item in SPEC["paths"].items():
        for method, operation in item.items():
            if method in METHODS and "requestBody" in operation:
                content = operation["requestBody"]["content"]
                assert set(content) == {"application/json", "application/msgpack"}, f"{method} {path}"
                assert {"400", "413", "415", "422"} <= set(operation["responses"]), f"{method} {path}"


def problem_schema_of(slug: str) -> dict[str, Any]:
    by_type = {}
    for name, schema in SPEC["components"]["schemas"].items():
        if not name.endswith("Problem") or name == "Problem":
            continue
        properties = schema["allOf"][1]["properties"] if "allOf" in schema else schema["properties"]
        by_type[json.dumps(properties["type"])] = properties
    return by_type[json.dumps({"const": problems.PROBLEM_BASE + slug})]


def test_problem_types_titles_and_statuses_are_the_service_errors() -> None:
    documented = set(SPEC["components"]["schemas"]["Problem"]["properties"]["type"]["enum"])
    service = {problems.PROBLEM_BASE + error.slug for error in problems.STATUS}
    assert documented == service | {"about:blank"}
    for error, status in problems.STATUS.items():
        if error is errors.NotFound:
            continue  # its schema also allows about:blank (a path that matches no route)
        properties = problem_schema_of(error.slug)
        assert properties["title"] == {"const": error.title}, error.slug
        assert properties["status"] == {"const": status}, error.slug


def test_docs_problems_table_lists_the_same_types() -> None:
    text = (ROOT / "docs" / "problems.md").read_text()
    listed = set(re.findall(r"^\| \d{3} \| `([a-z-]+)` \|", text, re.MULTILINE))
    assert listed == {error.slug for error in problems.STATUS}


def test_served_document_is_the_yaml() -> None:
    assert json.loads(DOCUMENT_JSON) == yaml.safe_load((ROOT / "service" / "openapi.yaml").read_text())


@pytest.fixture
async def memory_api() -> AsyncIterator[Api]:
    client = await start_client(test_settings(MEMORY_URL, sweep_interval_seconds=0.05))
    yield Api(client, ADMIN_TOKEN)
    await close_client(client)


async def test_get_openapi_json_serves_the_document_without_a_token(memory_api: Api) -> None:
    reply = await memory_api.call("GET", "/openapi.json")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    assert reply.body == load_document()


async def test_envelope_of_every_state_validates_and_the_state_rules_bite(memory_api: Api) -> None:
    api = memory_api
    agent = await api.principal("deploybot", "agent")
    alice = await api.principal("alice", "user")
    await api.room("oncall", ["alice"])
    pending = await api.ask(agent, {"room": "oncall"}, metadata={"build": 1})
    answered = await api.answer(alice, (await api.ask(agent, {"user": "alice"}))["id"], "yes")
    cancelled = await api.cancel(agent, (await api.ask(agent, {"user": "alice"}))["id"], "done")
    silent = await api.cancel(agent, (await api.ask(agent, {"user": "alice"}))["id"])
    short = await api.ask(agent, {"user": "alice"}, expires_in=1)
    expired = await api.wait(agent, short["id"], timeout=8)
    envelopes = {
        "pending": pending,
        "answered": answered.body["question"],
        "cancelled": cancelled.body["question"],
        "cancelled without reason": silent.body["question"],
        "expired": expired.body,
    }
    question = validator("Question")
    for label, envelope in envelopes.items():
        assert label.startswith(envelope["state"]), label
        errors_found = [e.message for e in question.iter_errors(envelope)]
        assert errors_found == [], label
    assert not question.is_valid({**envelopes["answered"], "state": "pending"})
    assert not question.is_valid({**envelopes["pending"], "state": "expired"})
    assert not question.is_valid({**envelopes["expired"], "state": "cancelled"})
    assert not question.is_valid({**envelopes["cancelled"], "answer": envelopes["answered"]["answer"]})
    outcome = validator("Outcome")
    assert outcome.is_valid(answered.body)
    assert outcome.is_valid(cancelled.body)
    page = await api.list(agent, limit=2)
    assert validator("Page").is_valid(page.body)
    assert page.body["next_cursor"] is not None


async def test_problem_bodies_validate_against_their_status_schema(memory_api: Api) -> None:
    api = memory_api
    cases = [
        (await api.call("POST", "/v1/questions", "nope", {}), "UnauthenticatedProblem"),
        (await api.call("POST", "/v1/admin/principals", api.admin, raw=b"{", headers={}), "MalformedProblem"),
        (await api.call("GET", "/v1/admin/rooms/none", api.admin), "NotFoundProblem"),
        (await api.call("GET", "/v1/questions", api.admin), "InvalidProblem"),
        (await api.call("GET", "/v1/nothing-here", api.admin), "NotFoundProblem"),
    ]
    for reply, schema in cases:
        assert reply.headers["Content-Type"] == "application/problem+json", schema
        assert validator(schema).is_valid(reply.body), (schema, reply.body)
    assert not validator("MalformedProblem").is_valid(cases[0][0].body)
