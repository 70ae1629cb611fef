"""Checks that need an outside tool: skipped locally when it is missing, failed under CI.

    from ci import require_tool, require_module
    promtool = require_tool("promtool", "apt-get install -y --no-install-recommends prometheus")

`make test` installs every tool these checks use (the pip `test` extra, promtool via apt), so on a
CI machine (environment variable CI set, and not 0 / false / no) a missing one is a broken setup,
not a reason to skip: the check fails and says what to install. Locally it skips, with the same
install command as its reason.
"""
from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(what: str, install: str) -> NoReturn:
    message = f"{what} not installed ({install})"
    if in_ci():
        pytest.fail(f"{message}: CI is set and `make test` installs it, so this check must run, not skip",
                    pytrace=False)
    pytest.skip(message)


def require_tool(name: str, install: str, path: str | None = None) -> str:
    """The path of executable `name` (on PATH, else at `path`)."""
    found = shutil.which(name) or (path if path and os.access(path, os.X_OK) else None)
    if found is None:
        missing(name, install)
    return found


def require_module(name: str, install: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"python module {name}", install)
