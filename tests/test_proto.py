"""The checked-in gRPC code is exactly what proto/generate.sh makes from proto/shoal.proto."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GENERATED = ("shoal_pb2.py", "shoal_pb2.pyi", "shoal_pb2_grpc.py")


def test_generated_code_is_up_to_date(tmp_path):
    (tmp_path / "proto").mkdir()
    for name in ("shoal.proto", "generate.sh"):
        shutil.copy(REPO / "proto" / name, tmp_path / "proto" / name)
    subprocess.run(["bash", str(tmp_path / "proto" / "generate.sh")], check=True, timeout=120,
                   env={**os.environ, "PYTHON": sys.executable})
    for name in GENERATED:
        fresh = (tmp_path / "proto" / name).read_text()
        assert fresh == (REPO / "proto" / name).read_text(), f"run proto/generate.sh ({name})"
