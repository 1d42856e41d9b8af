"""Every use of a private megatron-core, mbridge or torch internal, behind one adapter per dependency.

``megatron_core``, ``mbridge`` and ``torch`` each name the version they were written against and refuse
any other at import (``require_version``): a private name can change in any release without notice, and
a changed one would otherwise surface as a wrong checkpoint rather than an error. ``tests/test_internals_contract.py``
asserts each internal's shape, so a version bump says exactly what moved (docs/design.md, "Private internals").
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

from packaging.version import Version

SKIP_VERSION_CHECK_ENV = "VERL_SKIP_INTERNALS_VERSION_CHECK"


def require_version(package: str, written_for: str, adapter: str) -> None:
    """Raise ImportError unless ``package``'s installed release is ``written_for`` (a local label such as
    ``+cpu`` is ignored); with ``VERL_SKIP_INTERNALS_VERSION_CHECK=1`` only warn."""
    found = importlib.metadata.version(package)
    if Version(found).release == Version(written_for).release:
        return
    message = (
        f"{package} {found} is installed, but {adapter} reads private internals of {package} {written_for} "
        f"(requirements.txt pins {package}=={written_for}). Install {package}=={written_for}; to move to {found}, "
        f"run tests/test_internals_contract.py against it, fix what it names in {adapter}, then update the pin "
        f"there and in requirements.txt. {SKIP_VERSION_CHECK_ENV}=1 skips this check at your own risk."
    )
    if os.environ.get(SKIP_VERSION_CHECK_ENV) == "1":
        warnings.warn(message, stacklevel=2)
        return
    raise ImportError(message)
