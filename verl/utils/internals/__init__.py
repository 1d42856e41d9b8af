"""Every use of a private megatron-core, mbridge or torch internal, behind one adapter per dependency.

A private name can change in any release without notice, and a changed one would otherwise surface as a
wrong checkpoint rather than an error. So each internal an adapter function reads is an ``Internal``,
checked where it is first used (it exists, with the parameters the adapter relies on): a missing or
changed one fails only the feature that needs it, with an ``InternalsChangedError`` naming it, or falls
back where a public path exists (each adapter function's docstring says which). Nothing is refused at
import: any release of the declared range (setup.py) imports; one outside the releases actually tested
(``TESTED``) gets one ``UntestedReleaseWarning`` naming the contract test. ``tests/test_internals_contract.py``
asserts each internal's shape, so a version bump says exactly what moved (docs/design.md, "Private internals").
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import warnings
from typing import Any

from packaging.version import Version

CONTRACT_TEST = "tests/test_internals_contract.py"

# The releases the internals contract test and the fix-1 / fix-2 / resume tests have passed on, per package
# (a local label such as ``+cpu`` is ignored); docs/cpu.md ("The stack") states the same table, with its date.
TESTED: dict[str, tuple[str, ...]] = {
    "torch": ("2.13.0", "2.14.1"),  # CPU CI: the main legs, the Python 3.12 leg (its CUDA build on the CPU)
    "megatron-core": ("0.16.1", "0.18.2"),  # CPU CI: the main legs, the Python 3.12 leg; no device run yet
    "mbridge": ("0.15.1",),
}
TESTED_ON = "2026-12-03"


class InternalsChangedError(RuntimeError):
    """A private internal that a feature needs is missing from the installed release, or has another shape."""


class UntestedReleaseWarning(UserWarning):
    """The installed release of a dependency is not one the internals were tested on (``TESTED``)."""


_warned: set[tuple[str, str]] = set()


def warn_if_untested(package: str) -> None:
    """One ``UntestedReleaseWarning`` per package and installed release in this process when that release is
    not in ``TESTED``; the adapters call it at import."""
    found = importlib.metadata.version(package)
    if Version(found).release in {Version(point).release for point in TESTED[package]} or (package, found) in _warned:
        return
    _warned.add((package, found))
    warnings.warn(
        f"{package} {found} is not a release verl's use of its private internals was tested on "
        f"({', '.join(TESTED[package])}): each internal is checked where first used, and a changed one fails the "
        f"feature that needs it, naming it. Run {CONTRACT_TEST} (and the fix-1 / fix-2 / resume tests) against "
        f"{package} {found} before relying on it (docs/cpu.md, 'The stack').",
        UntestedReleaseWarning,
        stacklevel=3,
    )


@dataclasses.dataclass(frozen=True)
class Internal:
    """One private name of a dependency, as an adapter relies on it.

    ``path`` is ``module:attribute[.attribute...]``; ``params``, when given, the parameter names of the
    callable it must be (``inspect.signature``), all of them or, with ``exact=False``, its first ones (a
    replacement verl installs must take exactly what megatron passes; a call verl makes only needs what
    it passes). ``feature`` says what needs it, for the error.
    """

    package: str
    path: str
    feature: str
    params: tuple[str, ...] | None = None
    exact: bool = True

    @property
    def name(self) -> str:
        return self.path.replace(":", ".")

    def get(self, owner: Any = None) -> Any:
        """The internal as installed now, checked; with ``owner`` (a subclass or instance of the class the path
        names) the member is read from it, so an override is what is checked. Raises ``InternalsChangedError``.

        A value that passed its check is remembered (by identity), so a hot path pays one lookup per call."""
        module_name, _, attrs = self.path.partition(":")
        parts = attrs.split(".")
        if owner is not None:
            value, parts = owner, parts[1:]
        else:
            try:
                value = importlib.import_module(module_name)
            except Exception as exc:  # noqa: BLE001 - any failure to import it is a change, named
                raise self.changed(f"its module cannot be imported ({type(exc).__name__}: {exc})") from exc
        for part in parts:
            try:
                value = getattr(value, part)
            except AttributeError:
                raise self.changed("is missing") from None
        if self.params is None:
            return value  # its existence is the check
        key = (self, owner if isinstance(owner, type) else type(owner))
        if _checked.get(key) is not value:
            self._check(value)
            _checked[key] = value
        return value

    def _check(self, value: Any) -> None:
        if not callable(value):
            raise self.changed(f"is no longer callable (found {type(value).__name__})")
        found = tuple(inspect.signature(value).parameters)
        if found != self.params if self.exact else found[: len(self.params)] != self.params:
            raise self.changed(f"takes {found}")

    def changed(self, problem: str) -> InternalsChangedError:
        """The error for this internal: package and installed release, the internal, what was expected, what to run."""
        expected = f"a callable taking {self.params}{'' if self.exact else ' first'}" if self.params else "it"
        return InternalsChangedError(
            f"{self.package} {importlib.metadata.version(self.package)}: {self.name} {problem}; {self.feature} needs "
            f"{expected}. Run {CONTRACT_TEST} against this release and adapt verl/utils/internals to what it names."
        )


_checked: dict[tuple[Internal, Any], Any] = {}
