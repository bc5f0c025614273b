"""The SDK's build step beyond pyproject.toml: the gRPC stubs in specdec/v1/ are generated
from the repository's protos/ (beside this folder) by grpcio-tools whenever the package is
built (wheel, editable install, sdist), and are not tracked in git. An sdist carries them,
so a build from an sdist, which has no protos/, uses those."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTOS = HERE.parent / "protos"
STUBS = HERE / "specdec" / "v1"


def generate_stubs() -> None:
    protos = sorted((PROTOS / "specdec" / "v1").glob("*.proto"))
    if not protos:
        if any(STUBS.glob("*_pb2.py")):
            return  # an sdist: generated when it was made
        raise SystemExit(
            f"specdec-sdk: no {PROTOS}/specdec/v1/*.proto to generate the gRPC stubs from; "
            "build the SDK from the repository checkout (or from its sdist)"
        )
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"  # the well-known types
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={HERE}",
        f"--pyi_out={HERE}",
        f"--grpc_python_out={HERE}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"specdec-sdk: protoc failed on {', '.join(p.name for p in protos)}")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


class SdistWithStubs(sdist):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithStubs})
