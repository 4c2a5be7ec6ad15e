"""Regenerates the Python modules of the wire contract from protos/*.proto.

Run from anywhere: ``python -m protos.generate [OUT_DIR]``. OUT_DIR defaults to the
repository root, so the modules land beside their sources; the drift test points it
at a scratch directory and compares.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("common.proto", "ar.proto", "dit.proto")


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Compiles every .proto into ``out_dir/protos`` and returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "protos").mkdir(exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(f"protos/{name}" for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_dir / "protos").iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(target):
        print(path)
