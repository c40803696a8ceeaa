"""Generates the gRPC Python stubs in shared/api from proto/tandem/v1/tandem.proto.

Run `python proto/codegen.py` (or `make proto`) after editing the proto (needs grpcio-tools, a dev dependency).
The stubs are committed; tests/unit/test_api_stubs.py fails when they are stale.
"""

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
PROTO = "tandem/v1/tandem.proto"
OUT_DIR = ROOT / "shared" / "api"
STUBS = ("tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py")


def generate() -> dict[str, str]:
    """Returns {file name: text} of the stubs the current proto produces."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_DIR / PROTO),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + PROTO)
        out = Path(tmp) / "tandem" / "v1"
        texts = {name: (out / name).read_text() for name in STUBS}
    # protoc writes an absolute import of the proto package; the stubs live in shared.api.
    texts["tandem_pb2_grpc.py"] = re.sub(
        r"^from tandem\.v1 import tandem_pb2",
        "from shared.api import tandem_pb2",
        texts["tandem_pb2_grpc.py"],
        flags=re.M,
    )
    return texts


def main() -> int:
    for name, text in generate().items():
        (OUT_DIR / name).write_text(text)
    print("wrote", ", ".join(STUBS), "to", OUT_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
