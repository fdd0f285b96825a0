"""Tasks on fsspec's event loop whose exceptions nobody reads: what tracestore does about them.

fsspec runs every async filesystem that tracestore calls synchronously (s3fs; gcsfs and adlfs the
same way) on one event loop in a thread of its own. aiohttp, under s3fs and aiobotocore, sends a
request's body from a task of its own (``ClientRequest.write_bytes``). When the connection is
reset before the body goes out (a load balancer or proxy in front of an S3 that is down resets
the connections it accepts), that task fails with a connection error, and so does the request
itself: botocore raises it, s3fs and :class:`~tracestore.storage.fs.Storage` retry it, count it
and report it. Nobody reads the body task's exception, though, so when the task is collected the
loop would log "Task exception was never retrieved" at ERROR with a traceback, once per request.

:func:`read_unread_body_errors` gives the loop an exception handler that takes exactly those
reports (a finished ``write_bytes`` task of aiohttp whose exception is a connection error) and
logs them at DEBUG on ``tracestore.storage``; it passes every other report on to the handler
that was there before, or to the loop's default one, so any other unread exception is still
logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger("tracestore.storage")

_lock = threading.Lock()
_BODY_WRITER = "ClientRequest.write_bytes"


def _connection_error(exc: BaseException) -> bool:
    if isinstance(exc, OSError):  # ClientConnectionResetError, ClientOSError, TimeoutError
        return True
    aiohttp = sys.modules.get("aiohttp")
    return aiohttp is not None and isinstance(exc, aiohttp.ClientConnectionError)


def is_unread_body_error(context: dict[str, Any]) -> bool:
    """Whether an exception-handler ``context`` reports an aiohttp request-body task that ended
    with a connection error nobody read (the request reports that failure on its own)."""
    task, exc = context.get("future"), context.get("exception")
    if not isinstance(task, asyncio.Task) or exc is None or not _connection_error(exc):
        return False
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None)
    return (
        getattr(coro, "__qualname__", "") == _BODY_WRITER
        and code is not None
        and f"{os.sep}aiohttp{os.sep}" in code.co_filename
    )


def read_unread_body_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Give ``loop`` the exception handler described in this module's docstring (once per loop;
    a later call finds it and does nothing). It wraps the loop's handler at the time of the call."""
    with _lock:
        previous = loop.get_exception_handler()
        if getattr(previous, "tracestore_reads_body_errors", False):
            return

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if is_unread_body_error(context):
                log.debug(
                    "storage client: a request body was not sent (%r); the request itself failed with it "
                    "and was retried or reported",
                    context.get("exception"),
                )
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        handle.tracestore_reads_body_errors = True  # type: ignore[attr-defined]
        loop.set_exception_handler(handle)
