"""Every failure of a ``flashpoint`` command as one line on stderr that says what to do.

:func:`guarded` runs a command: an exception becomes ``SystemExit("error: ...")`` (exit 1,
the line on stderr, no traceback); a closed stdout (``flashpoint functions | head``) ends
the command quietly. ``--debug`` or ``FLASHPOINT_DEBUG=1`` lets the exception through with
its traceback, for developers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from flashpoint.errors import BadRequest, ConnectFailed, FlashpointError, RegistryError

DEBUG_ENV = "FLASHPOINT_DEBUG"
HTTP_STATUS = "http_status"  # the detail an API error answer carries its status in
EXIT_BROKEN_PIPE = 1  # what Python's own docs use when stdout's reader went away
_BIND = re.compile(r"\('([^']*)', (\d+)")


def no_cluster(url: str, why: str) -> ConnectFailed:
    """Nothing answers at the API URL (connection refused, unknown host, timeout)."""
    return ConnectFailed(f"no cluster at {url} ({why}) — start one with `flashpoint up`, "
                         "or pass --url (or set FLASHPOINT_URL)", url=url)


def _connect_reason(exc: Any) -> str:
    """``connection refused`` and the like, from aiohttp's connector error."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, ConnectionRefusedError):
        return "connection refused"
    return (getattr(os_error, "strerror", None) or str(os_error or exc)).lower()


@contextlib.contextmanager
def reaching(url: str, base: str = "") -> Iterator[None]:
    """Around a call to the cluster's API at ``url``: a bad URL is BadRequest; nothing
    answering (or the connection failing) is :func:`no_cluster` naming ``base`` (the
    cluster's URL) or ``url``."""
    import aiohttp

    try:
        yield
    except aiohttp.InvalidURL:
        raise BadRequest(f"{url} is not a URL (--url wants e.g. http://127.0.0.1:8080)") from None
    except aiohttp.ClientConnectorError as e:
        raise no_cluster(base or url, _connect_reason(e)) from None
    except (aiohttp.ClientError, TimeoutError) as e:
        raise no_cluster(base or url, str(e) or type(e).__name__) from None


def api_error(status: int, text: str) -> FlashpointError:
    """The typed error an API error answer (``status``, body ``text``) stands for
    (``client.error_from_body``), with the status in ``details["http_status"]``."""
    from flashpoint.client import error_from_body

    try:
        data: Any = json.loads(text)
    except ValueError:
        data = text  # not JSON (a proxy's error page, say): shown as it came
    err = error_from_body(status, data)
    err.details[HTTP_STATUS] = status
    return err


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of an API error answer (flashpoint/cli/api.py sets it), else None."""
    status = exc.details.get(HTTP_STATUS) if isinstance(exc, FlashpointError) else None
    return status if isinstance(status, int) else None


def debug_wanted(flag: bool = False) -> bool:
    """``--debug`` was given or FLASHPOINT_DEBUG is set to something other than 0/empty."""
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "no")


def guarded(run: Callable[[], int], *, cmd: str, debug: bool) -> int:
    """``run()``'s exit code; any exception but SystemExit as one ``error:`` line (exit 1)."""
    try:
        return run()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT: what a shell reports for Ctrl-C
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except BaseException as e:
        if debug:
            raise
        status = http_status(e)
        prefix = f"error {status}" if status is not None else "error"
        raise SystemExit(f"{prefix}: {describe(e, cmd)}") from None


def describe(exc: BaseException, cmd: str = "") -> str:
    """One line for ``exc``: what went wrong and, where we know it, what to do (an API
    error's HTTP status is the caller's prefix: ``error 404: function_not_found: ...``)."""
    status = http_status(exc)
    if isinstance(exc, FlashpointError) and status is not None:
        hint = {401: " — pass --api-key (or set FLASHPOINT_API_KEY)",
                403: " — this needs an admin API key"}.get(status, "")
        code = exc.details.get("remote_code") or exc.code  # a code this side does not know
        return _one_line(f"{code}: {exc.message}{hint}")
    if isinstance(exc, RegistryError):
        return _one_line(exc.message + _registry_hint(exc))
    if isinstance(exc, FlashpointError):
        return _one_line(exc.message or exc.code)
    if type(exc).__module__.startswith("botocore"):  # one the store could not translate
        return _one_line(f"S3 client: {exc} — check the AWS configuration (AWS_PROFILE, "
                         "AWS_DEFAULT_REGION, [registry] region and endpoint_url)")
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return _port_in_use(exc, cmd)
    if isinstance(exc, OSError) and exc.filename:
        return _one_line(f"{exc.filename}: {exc.strerror or exc}")
    # A ValueError's message is written for the user (a bad choice, say); other types name
    # themselves, for a bug report.
    text = str(exc) if isinstance(exc, ValueError) and str(exc) else \
        f"{type(exc).__name__}: {exc}".rstrip(": ")
    return _one_line(f"{text} (run with --debug or {DEBUG_ENV}=1 for "
                     "the traceback)")


def _registry_hint(exc: RegistryError) -> str:
    """What to check for an S3 failure, from its status and S3 error code."""
    s3_code, status = str(exc.details.get("s3_code") or ""), exc.details.get("status")
    if s3_code == "NoSuchBucket":
        return " — create the bucket, or fix [registry] bucket in --config"
    if s3_code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                   "ExpiredToken") or status in (401, 403):
        return (" — check the AWS credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                "a profile or a role) and the bucket policy")
    if "credentials" in exc.message:
        return ""  # the store's own message says what to set
    if status is None and "bucket" in exc.details:
        return " — check [registry] endpoint_url and that the S3 endpoint is reachable"
    return ""


def _port_in_use(exc: OSError, cmd: str) -> str:
    m = _BIND.search(str(exc))
    where = f"port {m.group(2)} on {m.group(1)}" if m else "the listen port"
    setting = {"gateway": "--port or [gateway] listen_port",
               "host": "[host] data_port or metrics_listen"}.get(cmd, "[controller] listen_port")
    return (f"{where} is already in use (another `flashpoint up` or controller?) — stop that "
            f"process, or set {setting} in --config")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture)
        pass

