"""The default model is package data: a wheel (what `pip install .` installs) carries it."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_carries_the_default_model_kernel_sources_and_dashboard(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("kvgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("stories260K.bin", "tok512.bin", "README.md", "LICENSE"):
        assert f"kvgen/models/stories260K/{name}" in names
    sources = {str(p.relative_to(REPO)) for pattern in ("*.c", "*.h") for p in (REPO / "kvgen").rglob(pattern)}
    assert sources and sources <= names, f"C sources the kernels compile at run time but the wheel lacks: {sources - names}"
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        assert f"kvgen/server/dashboard/static/{name}" in names
