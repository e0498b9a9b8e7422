"""The oldest torch tilework accepts: one number (tilework.MIN_TORCH), the same as the package's
declared range, and an older torch refused at import in one line (docs/torch-versions.md)."""

import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:   # Python 3.10
    import tomli as tomllib

import tilework

ROOT = Path(__file__).resolve().parents[2]


def test_the_declared_floor_is_the_checked_one():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_dep = next(d for d in deps if d.split(">=")[0].strip() == "torch")
    floor = tuple(int(x) for x in torch_dep.split(">=")[1].split(",")[0].strip().split("."))
    assert floor == tilework.MIN_TORCH


def test_an_older_torch_is_refused_at_import_in_one_line():
    code = "import torch; torch.__version__ = '2.5.1+cu124'; import tilework"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    floor = ".".join(map(str, tilework.MIN_TORCH))
    assert last == (f"ImportError: tilework needs torch >= {floor}, this is torch 2.5.1+cu124: "
                    f"pip install 'torch>={floor}' (or your CUDA build)"), r.stderr[-2000:]
