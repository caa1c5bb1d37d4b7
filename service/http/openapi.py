"""`GET /openapi.json`: the OpenAPI document (service/openapi.yaml, the source of truth), as JSON.

The YAML is read and rendered once, when this module is imported (that is, when the app is
built), so a broken document stops the service at start instead of failing a request later.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml
from aiohttp import web

from service.model import to_json


def load_document() -> dict[str, Any]:
    """The OpenAPI document as shipped inside the package."""
    text = resources.files("service").joinpath("openapi.yaml").read_text(encoding="utf-8")
    document = yaml.safe_load(text)
    if not isinstance(document, dict) or "openapi" not in document:
        raise RuntimeError("service/openapi.yaml is not an OpenAPI document")
    return document


DOCUMENT_JSON = to_json(load_document())


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=DOCUMENT_JSON, content_type="application/json")
