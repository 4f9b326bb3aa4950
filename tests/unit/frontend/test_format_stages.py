"""Each format's ``validate`` module lists the stages a body goes through, in the order
``STAGES`` runs them: the docstring a reader reads first says what the code does."""

from __future__ import annotations

import re
from types import ModuleType

import pytest

from sidecar_frontend.formats.sglang import validate as sglang_validate
from sidecar_frontend.formats.vllm import validate as vllm_validate


def _documented(module: ModuleType) -> list[str]:
    # "1. ``model``: ...", one numbered entry per stage.
    return re.findall(r"^\d+\. ``(\w+)``", module.__doc__ or "", flags=re.MULTILINE)


@pytest.mark.parametrize("module", [sglang_validate, vllm_validate], ids=["sglang", "vllm"])
def test_the_docstring_lists_the_stages_in_the_order_they_run(module: ModuleType) -> None:
    stages = [stage.name for stage in module.STAGES]
    assert stages[-1] == "plan"
    assert _documented(module) == stages
