"""The SGLang format's informational routes and the fleet's weight version
(sidecar_frontend/formats/sglang/__init__.py): ``/model_info`` answers the fleet's newest
version as SGLang answers its current one, ``"default"`` while there is none; ``/server_info``
is SGLang's launch configuration and stays at the frontend's launch value."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sidecar_frontend.formats.base import Route, RouteKind
from sidecar_frontend.formats.sglang import SglangFormat
from tests.unit.frontend.test_format_sglang_support import context


def weight_version(path: str, fleet_version: str | None) -> object:
    ctx = replace(context(), weight_version=fleet_version)
    reply = SglangFormat().info(Route(("GET",), path, RouteKind.INFO), ctx)
    assert reply.status == 200
    return json.loads(reply.body)["weight_version"]


@pytest.mark.parametrize(
    ("path", "fleet_version", "expected"),
    [
        ("/model_info", "step-12", "step-12"),
        ("/get_model_info", "step-12", "step-12"),
        ("/model_info", None, "default"),
        ("/get_model_info", None, "default"),
        # A fleet whose engines were launched with --weight-version default and never updated.
        ("/model_info", "default", "default"),
        ("/server_info", "step-12", "default"),
        ("/get_server_info", "step-12", "default"),
        ("/server_info", None, "default"),
    ],
)
def test_the_weight_version_each_info_route_answers(
    path: str, fleet_version: str | None, expected: str
) -> None:
    assert weight_version(path, fleet_version) == expected
