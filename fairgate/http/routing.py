"""Routes: exact paths, and prefixes whose rest is a named parameter (``/v1/models/{model}``).

A path is matched as the client sent it, percent-encoding included: ``/%6detrics`` is not ``/metrics`` (a route
reached only through an encoded spelling would bypass whatever a proxy in front checks by path). Only a
parameter is percent-decoded (``/v1/models/org%2Fname`` names the model ``org/name``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable
from urllib.parse import unquote

if TYPE_CHECKING:
    from fairgate.http.messages import Request, Response, StreamResponse

Handler = Callable[["Request"], Awaitable["Response | StreamResponse"]]


class NotRouted(Exception):
    """No route: 404, or 405 with the methods the path has (``allow``)."""

    def __init__(self, status: int, allow: tuple[str, ...] = ()):
        super().__init__("Not Found" if status == 404 else "Method Not Allowed")
        self.status, self.allow = status, allow


class Router:
    def __init__(self) -> None:
        self.exact: dict[str, dict[str, Handler]] = {}
        self.prefixes: list[tuple[str, str, dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.exact.setdefault(path, {})[method] = handler

    def add_prefix(self, method: str, prefix: str, name: str, handler: Handler) -> None:
        for p, n, methods in self.prefixes:
            if (p, n) == (prefix, name):
                methods[method] = handler
                return
        self.prefixes.append((prefix, name, {method: handler}))

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """O(1) for an exact path, O(prefixes) otherwise. Raises ``NotRouted``."""
        methods, match = self.exact.get(path), {}
        if methods is None:
            for prefix, name, ms in self.prefixes:
                if path.startswith(prefix) and len(path) > len(prefix):
                    value = path[len(prefix):]
                    if "%" in value:
                        try:  # (the path is as sent, one character a byte: its bytes, percent-decoded, as UTF-8)
                            value = unquote(value.encode("latin-1").decode("ascii"), errors="strict")
                        except UnicodeError:  # not UTF-8 once decoded, or raw non-ASCII: names nothing we serve
                            raise NotRouted(404) from None
                    methods, match = ms, {name: value}
                    break
        if methods is None:
            raise NotRouted(404)
        handler = methods.get(method)
        if handler is None:
            raise NotRouted(405, tuple(sorted(methods)))
        return handler, match
