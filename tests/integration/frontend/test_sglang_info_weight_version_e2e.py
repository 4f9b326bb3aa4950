"""The SGLang format's ``/model_info`` follows the fleet's weight version end to end: a testkit
SGLang HTTP engine behind its sidecar and a frontend, the engine's version changed through its
own ``/update_weight_version`` as a trainer does; ``/server_info`` keeps the launch value, as
SGLang's does."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.frontend.test_fleet_e2e import Fleet, fleet

pytestmark = pytest.mark.timeout(120)


async def info(running: Fleet, path: str) -> dict[str, Any]:
    async with running.http.get(running.url + path) as response:
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def test_model_info_follows_the_engines_weight_version() -> None:
    async with fleet(["v1"]) as running:
        assert (await info(running, "/model_info"))["weight_version"] == "v1"
        await running.set_version(0, "v2")
        await running.until(lambda: running.workers.registry.versions.newest == "v2")
        assert (await info(running, "/model_info"))["weight_version"] == "v2"
        assert (await info(running, "/get_model_info"))["weight_version"] == "v2"
        assert (await info(running, "/server_info"))["weight_version"] == "default"
