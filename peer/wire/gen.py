"""Generate the Python stubs of proto/*.proto into peer/wire/ (`python -m peer.wire.gen`).

The .proto files are mapped to the virtual path `peer/wire/` (`--proto_path=peer/wire=proto`), so
the generated modules import each other as `peer.wire.<name>_pb2` and live next to this file.
tests/test_wire.py regenerates into a temporary directory and compares byte for byte, so the
committed stubs can never drift from the .proto sources.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
WIRE_DIR = Path(__file__).resolve().parent
VIRTUAL_PACKAGE = "peer/wire"


def proto_files() -> list[Path]:
    """The .proto sources, sorted so that generation is deterministic."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpc_tools) on every proto/*.proto and write the stubs into `out_dir`.

    Writes `<name>_pb2.py`, `<name>_pb2.pyi` and `<name>_pb2_grpc.py` for each source and returns
    the written paths, sorted. Raises RuntimeError if protoc fails (its message goes to stderr).
    """
    from grpc_tools import protoc

    sources = proto_files()
    if not sources:
        raise RuntimeError(f"no .proto files in {PROTO_DIR}")
    include = str(resources.files("grpc_tools") / "_proto")  # well-known types (google/protobuf/*)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={VIRTUAL_PACKAGE}={PROTO_DIR}",
            f"--proto_path={include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f"{VIRTUAL_PACKAGE}/{src.name}" for src in sources),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit status {rc}: {' '.join(args[1:])}")
        for generated in sorted((Path(tmp) / VIRTUAL_PACKAGE).iterdir()):
            target = out_dir / generated.name
            shutil.copyfile(generated, target)
            written.append(target)
    return written


def main() -> None:
    for path in generate(WIRE_DIR):
        print(path.relative_to(REPO_ROOT))


if __name__ == "__main__":
    sys.exit(main())
