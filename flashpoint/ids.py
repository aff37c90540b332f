"""Typed identifiers and name validation.

Names that reach file paths or object keys (models, functions) are validated here, once,
so no caller can smuggle ``..`` or ``/`` into the registry or the cache.
"""

from __future__ import annotations

import os
import re

from flashpoint.errors import InvalidName

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def validate_name(name: object, what: str = "name") -> str:
    """Return ``name`` if it is a safe resource name, else raise :class:`InvalidName`.

    Lower-case letters, digits, ``.``, ``_`` and ``-``; 1-63 characters; starts with a letter
    or digit; never ``.`` or ``..`` sequences that could walk a path.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidName(
            f"invalid {what} {name!r:.80}: use 1-63 of [a-z0-9._-], starting with a letter or digit",
            field=what,
        )
    return name


def validate_version(version: object) -> str:
    """Validate a model version tag (same rules as names, upper case allowed)."""
    if not isinstance(version, str) or not _VERSION_RE.fullmatch(version) or ".." in version:
        raise InvalidName(f"invalid version {version!r:.80}", field="version")
    return version


def new_id(prefix: str) -> str:
    """A short random id with a readable prefix (``req-3f2a...``)."""
    # 64 random bits straight from the OS: what uuid4().hex[:16] gave, without building a
    # UUID object (a quarter of the cost on every request).
    return f"{prefix}-{os.urandom(8).hex()}"


class ModelKey(str):
    """One model version, ``name@version``: how caches, transfers, stage holds, roll-outs and
    logs name it. A ``str`` so that its wire and log form is that very string and a key read
    back from a peer compares equal to one built here; build it with :meth:`of` (or
    ``Manifest.key``, ``FunctionSpec.model_key``) and read its parts with :attr:`name` and
    :attr:`version`, never by formatting or splitting the string by hand. Names and versions
    cannot contain ``@`` (:func:`validate_name`, :func:`validate_version`), so the split is
    exact."""

    __slots__ = ()

    @classmethod
    def of(cls, name: str, version: str) -> ModelKey:
        return cls(f"{name}@{version}")

    @classmethod
    def parse(cls, key: str) -> ModelKey:
        """``key`` as a ModelKey; InvalidName when it has no ``@`` between two parts."""
        name, at, version = key.rpartition("@")
        if not at or not name or not version:
            raise InvalidName(f"invalid model key {key!r:.80}: expected name@version",
                              field="model_key")
        return key if isinstance(key, ModelKey) else cls(key)

    @property
    def name(self) -> str:
        return self.rpartition("@")[0]

    @property
    def version(self) -> str:
        return self.rpartition("@")[2]
