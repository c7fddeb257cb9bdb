"""Regenerates sluice/v1/*_pb2*.py from protos/sluice/v1/*.proto.

The generated modules import each other absolutely (`from sluice.v1 import common_pb2`),
which resolves because the generated package lives at the top-level `sluice/v1/`.
Used by `make protos` and by the test that checks the committed code is current.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "sluice" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc into out_dir and returns the generated files (relative to out_dir)."""
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code differs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        stale = [f for f in files if not (ROOT / f).exists() or (ROOT / f).read_bytes() != (Path(tmp) / f).read_bytes()]
        if args.check:
            for f in stale:
                print(f"stale: {f}")
            return 1 if stale else 0
        for f in files:
            shutil.copyfile(Path(tmp) / f, ROOT / f)
            print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
