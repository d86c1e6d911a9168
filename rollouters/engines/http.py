"""One JSON-over-HTTP call with a timeout, for the engines that talk to a server (vLLM's
OpenAI server, SGLang). Standard library only, so the HTTP engines add no dependency.

Every failure becomes one of the caller's two exception types, so each engine keeps errors
that name it: ``error`` for an HTTP error status or an unreachable server, ``timeout`` when no
answer came within ``timeout_s`` (a timeout is what the weight sync's eviction acts on, so it
must stay distinguishable from a refusal).

``timeout_s`` bounds every wait on the socket: connecting, and each read of the answer. A
frozen server (its process alive, its socket accepting, nothing ever answered: SIGSTOPped, or
its engine stuck) thus costs one ``timeout_s`` and a ``timeout`` error that names the URL and
``timeout_key``, the config key that sets the timeout, instead of a worker that hangs.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

MAX_DETAIL = 500  # characters of an error body kept in the message


def request_json(method: str, url: str, path: str, body: dict[str, Any] | None,
                 timeout_s: float, error: type[Exception],
                 timeout: type[Exception], timeout_key: str = "") -> Any:
    """``method`` ``url + path`` with ``body`` as JSON; the decoded answer (None if empty)."""
    where = f"{method} {url}{path}"
    late = f"{where}: no answer within {timeout_s:.1f}s" + (
        f" ({timeout_key}): is the server frozen or overloaded?" if timeout_key else "")
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:MAX_DETAIL]
        refused = error(f"{where}: HTTP {exc.code}: {detail}")
        refused.status = exc.code   # read by http_status: 404 = a route this server lacks
        raise refused from exc
    except TimeoutError as exc:
        raise timeout(late) from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise timeout(late) from exc
        raise error(f"{where}: unreachable: {exc.reason}") from exc
    except OSError as exc:  # a connection reset mid-answer
        raise error(f"{where}: {exc}") from exc
    return json.loads(raw) if raw.strip() else None


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of an error :func:`request_json` raised for one, else None."""
    return getattr(exc, "status", None)
