"""The wheel carries the public contract: a frontend in another language gets the exact
``.proto`` the installed sidecar serves, through importlib.resources."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from tests.deploy.conftest import ROOT

PROTO = "sidecar/v1/sidecar.proto"
MEMBER = f"sidecar_common/api/proto/{PROTO}"

# Run with -S (no site-packages, so not the editable checkout) and only the wheel on the path:
# what it prints comes from the wheel or not at all.
_READ_FROM_WHEEL = """
import sys
sys.path.insert(0, sys.argv[1])
import importlib.resources
import sidecar_common.api
assert sidecar_common.api.__file__.startswith(sys.argv[1]), sidecar_common.api.__file__
proto = importlib.resources.files("sidecar_common.api").joinpath("proto", *sys.argv[2].split("/"))
sys.stdout.write(proto.read_text(encoding="utf-8"))
"""


def test_the_wheel_holds_the_public_proto(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as wheel:
        names = wheel.namelist()
        assert MEMBER in names
        assert wheel.read(MEMBER) == (ROOT / "protos" / PROTO).read_bytes()
    # The SGLang subset is the sidecar's own wire to its engine, not a contract.
    assert not [name for name in names if name.endswith("sglang.proto")]


def test_the_proto_loads_from_the_wheel_through_importlib_resources(
    built_wheel: Path, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-S", "-c", _READ_FROM_WHEEL, str(built_wheel), PROTO],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    # Compile what came out of the wheel, as a Go or Rust author would with their protoc.
    include = tmp_path / "include"
    (include / PROTO).parent.mkdir(parents=True)
    (include / PROTO).write_text(result.stdout, encoding="utf-8")
    descriptor_set = tmp_path / "sidecar.pb"
    well_known = Path(protoc.__file__).parent / "_proto"
    assert (
        protoc.main(
            ["protoc", f"-I{include}", f"-I{well_known}", f"--descriptor_set_out={descriptor_set}", PROTO]
        )
        == 0
    )
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes())
    (compiled,) = files.file
    assert compiled.package == "sidecar.v1"
    (service,) = compiled.service
    assert service.name == "Worker"
    assert [m.name for m in service.method] == [
        "Generate",
        "Abort",
        "GetModelInfo",
        "GetLoad",
        "WatchLoad",
        "WatchKvCache",
        "FlushCache",
    ]


# The production wheel (and so the image, which installs only it) holds the programs and
# their kernel; the CPU test engines are their own distribution (testkit/pyproject.toml).
PRODUCT_PACKAGES = {
    "sidecar_common",
    "sidecar_server",
    "sidecar_vllm",
    "sidecar_sglang",
    "sidecar_frontend",
    "sidecar_command",
}


def test_the_wheel_carries_the_product_and_no_test_engines(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as wheel:
        top = {name.split("/", 1)[0] for name in wheel.namelist() if "/" in name}
    packages = {name for name in top if not name.endswith(".dist-info")}
    assert packages == PRODUCT_PACKAGES


def test_the_image_copies_no_test_engines() -> None:
    copied = [
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines()
        if line.startswith("COPY ") and "--from=" not in line
    ]
    assert "testkit" not in " ".join(copied)
    assert {name for name in copied if name.startswith("sidecar_")} == PRODUCT_PACKAGES
