"""docs/api.md keeps up with the proto: every RPC, message, field and enum value of
sidecar.v1, and every error reason with its gRPC code and migratable flag, is documented."""

from __future__ import annotations

import re
from collections.abc import Iterator

from google.protobuf.descriptor import Descriptor

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FRONTEND_STATUS
from tests.deploy.conftest import ROOT

DOC = (ROOT / "docs" / "api.md").read_text()


def _messages(descriptors: list[Descriptor]) -> Iterator[Descriptor]:
    for message in descriptors:
        if message.GetOptions().map_entry:
            continue
        yield message
        yield from _messages(list(message.nested_types))


def test_every_rpc_is_documented_with_an_example() -> None:
    service = sidecar_pb2.DESCRIPTOR.services_by_name["Worker"]
    for method in service.methods:
        assert f"`{method.name}`" in DOC
        assert f"sidecar.v1.Worker/{method.name}" in DOC, f"no grpcurl example for {method.name}"


def test_every_message_field_and_enum_value_is_documented() -> None:
    file = sidecar_pb2.DESCRIPTOR
    for message in _messages(list(file.message_types_by_name.values())):
        assert f"`{message.name}`" in DOC, message.name
        for field in message.fields:
            row = re.search(rf"\| {field.number} \| `{field.name}` \|", DOC)
            assert row, f"{message.name}.{field.name} (#{field.number}) has no row"
        for enum in message.enum_types:
            for value in enum.values:
                assert f"`{value.name}`" in DOC, f"{message.name}.{enum.name}.{value.name}"
    for enum in file.enum_types_by_name.values():
        for value in enum.values:
            assert f"`{value.name}`" in DOC, f"{enum.name}.{value.name}"


def test_the_error_table_matches_the_code() -> None:
    for reason, status in FRONTEND_STATUS.items():
        migratable = "true" if status.migratable else "false"
        row = f"| `{reason.value}` | {status.code.name} | {migratable} |"
        assert row in DOC, row
