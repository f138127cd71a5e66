"""Skip a test module where a binary or privilege it needs is absent, except under CI (CI=true), where .ci/run
installs everything: there a missing piece is an error at collection, never a silent skip."""
from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    """Whether this is a CI run (CI=true, as CI services and .ci/run set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(*binaries: str) -> str | None:
    """Why these executables cannot run here (None if all are on PATH)."""
    absent = [b for b in binaries if shutil.which(b) is None]
    return f"not installed: {', '.join(absent)}" if absent else None


def available(why: str | None) -> pytest.MarkDecorator:
    """A module's ``pytestmark``: skip with ``why`` when it is not None; under CI raise instead (loud)."""
    if why is not None and in_ci():
        raise RuntimeError(f"CI=true but this test module cannot run: {why} (.ci/run installs what it needs)")
    return pytest.mark.skipif(why is not None, reason=why or "")
