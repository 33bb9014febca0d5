"""Regenerate the protobuf / gRPC modules in kvpool/proto from its .proto files.

    python tools/gen_proto.py

Generated files are committed so an install needs no protoc. Imports in them are
package-absolute (``from kvpool.proto import x_pb2``) because protoc runs from the
repository root with the files named as ``kvpool/proto/x.proto``.
"""

from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc  # type: ignore[import-untyped]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvpool" / "proto").glob("*.proto"))
    for proto in protos:
        rc = protoc.main(
            ["protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", proto]
        )
        if rc != 0:
            print(f"protoc failed on {proto}", file=sys.stderr)
            return rc
        print(f"generated {proto}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
