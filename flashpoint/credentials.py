"""Secrets handed over by systemd's ``LoadCredential=`` (deploy/systemd/, deploy/README.md).

systemd copies each credential into a private, read-only directory that only the service's
user can read and names it in ``$CREDENTIALS_DIRECTORY``; unlike an environment variable it
is not inherited by every child, nor shown in ``/proc/PID/environ``, and unlike a TOML file
it needs no world-readable copy on disk. Two credentials are read, by these names:

- ``secret``: the cluster secret, the whole file (a trailing newline is dropped);
- ``api_keys``: the gateway's API keys, a TOML table of ``"<key>" = "invoke" | "admin"``
  lines, merged over ``[gateway] api_keys`` of the config file.

Either may be absent; present, a credential wins over the config file and
``FLASHPOINT_SECRET`` (which still serve local runs and tests).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashpoint.errors import BadRequest

CREDENTIALS_ENV = "CREDENTIALS_DIRECTORY"
SECRET_CREDENTIAL = "secret"
API_KEYS_CREDENTIAL = "api_keys"


def read_credential(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of credential ``name``, or ``None`` when this process was given none."""
    directory = (os.environ if environ is None else environ).get(CREDENTIALS_ENV)
    if not directory:
        return None
    path = Path(directory) / name
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise BadRequest(f"credential {name!r} in ${CREDENTIALS_ENV} cannot be read: "
                         f"{type(e).__name__}") from None


def parse_api_keys(text: str) -> dict[str, str]:
    """``"<key>" = "<role>"`` lines (TOML) into a mapping; the error never quotes a key."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        where = re.search(r"line \d+", str(e))  # tomllib's message names no key; keep it so
        raise BadRequest(f"credential {API_KEYS_CREDENTIAL!r} is not TOML "
                         f"('\"<key>\" = \"<role>\"' lines)"
                         f"{': ' + where.group(0) if where else ''}") from None
    if not all(isinstance(role, str) for role in table.values()):
        raise BadRequest(f"credential {API_KEYS_CREDENTIAL!r}: every value is a role string")
    return dict(table)


def apply_credentials(data: dict[str, Any], environ: Mapping[str, str] | None = None) -> None:
    """Put the credentials this process was given into raw config ``data`` (in place)."""
    if (secret := read_credential(SECRET_CREDENTIAL, environ)) is not None:
        secret = secret.rstrip("\r\n")
        if not secret:
            raise BadRequest(f"credential {SECRET_CREDENTIAL!r} is empty")
        data["secret"] = secret
    if (keys := read_credential(API_KEYS_CREDENTIAL, environ)) is not None:
        gateway = data.setdefault("gateway", {})
        if not isinstance(gateway, dict):
            raise BadRequest("config section [gateway] must be a table")
        gateway["api_keys"] = {**gateway.get("api_keys", {}), **parse_api_keys(keys)}
