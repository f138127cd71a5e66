"""The repository holds sources, docs and recorded benchmark results, never binaries: no wheels, archives,
shared objects, pickles or other binary blobs among the tracked files. Tools the project uses are installed
(pyproject's extras, .ci/run), not committed. The one exception: the benchmark plots (PNG) that BENCHMARKS.md
embeds from docs/bench/, rendered from the JSON kept beside them.
"""
import fnmatch
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Packages, archives, compiled code, serialized arrays and objects: never tracked, whatever their content.
BINARY_SUFFIXES = (".whl", ".egg", ".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".rar", ".jar",
                   ".so", ".dylib", ".dll", ".pyd", ".a", ".o", ".obj", ".exe", ".pyc", ".pyo", ".npy", ".npz",
                   ".pkl", ".pickle", ".bin", ".h5", ".pt", ".safetensors", ".msgpack")
ALLOWED_BINARY = {"docs/bench/*.png": b"\x89PNG\r\n\x1a\n"}  # pattern: the magic every such file starts with


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and os.path.isfile(ROOT / p)]


def _is_text(data: bytes) -> bool:
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def binaries(paths: list[str], root: Path) -> list[str]:
    """The paths (relative to ``root``) that are binary: by suffix, or by content (NUL bytes, not UTF-8),
    except the allowed plots, which must be what their name says."""
    bad = []
    for p in paths:
        if p.lower().endswith(BINARY_SUFFIXES):
            bad.append(p)
            continue
        data = (root / p).read_bytes()
        magic = next((m for pat, m in ALLOWED_BINARY.items() if fnmatch.fnmatch(p, pat)), None)
        if magic is not None and data.startswith(magic):
            continue
        if not _is_text(data):
            bad.append(p)
    return bad


def test_no_binaries_are_tracked():
    paths = _tracked()
    assert "pyproject.toml" in paths and "README.md" in paths, paths[:20]
    assert binaries(paths, ROOT) == []


def test_the_check_finds_each_kind_of_binary(tmp_path):
    """Known answer: a wheel (even an empty one), an ELF shared object, a pickle, text in another encoding and a
    PNG outside docs/bench are found; text, JSON and a real plot under docs/bench are not."""
    files = {"tool-1.0-py3-none-any.whl": b"", "lib/_ext.cpython-311.so": b"\x7fELF\x02\x01\x01\0",
             "blob": b"\x80\x04\x95\x00\x00", "latin.txt": "café".encode("latin-1"),
             "docs/other/plot.png": b"\x89PNG\r\n\x1a\n\0\0", "docs/bench/fake.png": b"not a png\0",
             "README.md": "# jaxckpt — in memory\n".encode(), "docs/bench/save.json": b'{"bench": "save"}',
             "docs/bench/save.png": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    assert sorted(binaries(list(files), tmp_path)) == sorted(
        ["tool-1.0-py3-none-any.whl", "lib/_ext.cpython-311.so", "blob", "latin.txt", "docs/other/plot.png",
         "docs/bench/fake.png"])
