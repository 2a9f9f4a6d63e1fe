"""Bounds a connection keeps. ``HeadBounds``: what llhttp does not bound, for a protocol that feeds an httptools parser (the listener's connections, the
upstream client's): a head still arriving (httptools holds an unfinished line itself, so the bytes fed while it
is unfinished are counted) and the last chunk's trailer section (httptools concatenates a trailer value as it
arrives: unbounded, and superlinear in CPU). Head and trailers share one budget of bytes and of fields."""

from __future__ import annotations


class HeadBounds:
    max_head_bytes: int
    max_fields: int

    def _bounds_start(self) -> None:
        """A message begins (``on_message_begin``)."""
        self._in_head = self._began = True
        self._head_bytes = self._head_raw = self._trailer_raw = self._fields = 0

    def _bounds_clear(self) -> None:
        self._bounds_start()
        self._in_head = self._began = self._after_chunk_header = False

    def _over(self, what: str) -> Exception:
        """The protocol's error for a head or trailer section over the bounds."""
        raise NotImplementedError

    def _count(self, n: int) -> None:
        """``n`` bytes of a head's or a trailer's parsed line or field."""
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes:
            raise self._over(f"{'head' if self._in_head else 'head and trailers'} over {self.max_head_bytes} bytes")

    def _field(self, n: int) -> None:
        self._count(n)
        self._fields += 1
        if self._fields > self.max_fields:
            raise self._over(f"more than {self.max_fields} header and trailer fields")

    def _feeding(self) -> bool:
        """Before a feed: True if what it brings may be the trailer section (a chunk's size line came, none of its
        data yet); resets the head's start mark."""
        self._began = False
        return self._after_chunk_header

    def _fed(self, n: int, in_trailers: bool) -> None:
        """After a feed of ``n`` bytes: the head still arriving, or the trailers (no chunk data came), is bounded
        by what was fed to it (at most the bound plus this feed)."""
        if self._in_head:
            self._head_raw = 0 if self._began else self._head_raw + n
            if self._head_raw > self.max_head_bytes:
                raise self._over(f"head over {self.max_head_bytes} bytes")
        elif in_trailers and self._after_chunk_header:
            self._trailer_raw += n
            if self._head_bytes + self._trailer_raw > self.max_head_bytes:
                raise self._over(f"head and trailers over {self.max_head_bytes} bytes")

    # -- httptools callbacks -----------------------------------------------------------------------------------
    def on_chunk_header(self) -> None:
        self._after_chunk_header = True

    def on_chunk_complete(self) -> None:
        self._after_chunk_header = False


class Pace:
    """A token bucket of ``rate`` a second, a burst of as many (0: unpaced). O(1); time is passed in."""

    def __init__(self, rate: float, now: float):
        self.rate, self.tokens, self.stamp = rate, float(rate), now

    def wait(self, now: float) -> float:
        """0 if one may go now (a token taken), else the seconds until one may."""
        if not self.rate:
            return 0.0
        self.tokens = min(float(self.rate), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate
