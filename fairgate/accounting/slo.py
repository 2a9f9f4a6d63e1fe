"""SLO classes: the latency targets and the priority band an admin gives an app (`fairgate admin slo set`;
docs/guide/slo.md), a request's own targets within them, and whether it met them.

A class names a TTFT target (arrival at the gateway to the first token: queueing counts, AMBIG-12 of docs/policies/aladdin.md#open-choices)
and an ATGT target (the average time per token after the first, (finish − first token) / (tokens − 1)), either
optional, a band (``interactive`` above ``standard`` above ``batch``), whether its requests may be shed, and a
minimum share for its band. A request may tighten its targets with llm-d's headers (``x-slo-ttft-ms``,
``x-slo-tpot-ms``) where the app is allowed them (`fairgate admin app allow A slo-headers`), never loosen them:
a tenant never buys more than its class. Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

BANDS = ("interactive", "standard", "batch")  # served in this order
SLO_HEADERS = "slo-headers"  # the allowance `fairgate admin app allow A slo-headers` records
HEADERS = {"ttft_ms": "x-slo-ttft-ms", "atgt_ms": "x-slo-tpot-ms"}
MAX_MS = 3_600_000.0  # an hour: beyond it a target promises nothing
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NUMBER = re.compile(r"[0-9]{1,7}(\.[0-9]{1,3})?")


class SloError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    ttft_ms: float | None = None
    atgt_ms: float | None = None
    band: str = "standard"
    sheddable: bool = False
    min_share: float | None = None  # of the dispatches, kept for the band while it has requests waiting

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise SloError("a class name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        for what in ("ttft_ms", "atgt_ms"):
            v = getattr(self, what)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_MS):
                raise SloError(f"{what} is a number of milliseconds in (0, {MAX_MS:.0f}]")
        if self.band not in BANDS:
            raise SloError(f"band is one of {', '.join(BANDS)}")
        if not isinstance(self.sheddable, bool):
            raise SloError("sheddable is true or false")
        m = self.min_share
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < 1):
            raise SloError("min_share is a fraction in (0, 1)")

    @property
    def rank(self) -> int:
        """The band's place in the serving order (0 first)."""
        return BANDS.index(self.band)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> SloClass:
        if not isinstance(value, dict) or set(value) - set(cls.__slots__) or "name" not in value:
            raise SloError(f"not an SLO class: {value!r}")
        return cls(**value)

    def targets(self, headers: Mapping[str, str] | None) -> tuple[float | None, float | None]:
        """(TTFT, ATGT) targets in ms for one request: the class's, tightened by the request's headers if
        ``headers`` is given (None: the app is not allowed them, and they are not read)."""
        out = {"ttft_ms": self.ttft_ms, "atgt_ms": self.atgt_ms}
        for what, header in HEADERS.items():
            raw = headers.get(header) if headers is not None else None
            if raw is None:
                continue
            raw = raw.strip()
            if not _NUMBER.fullmatch(raw) or not 0 < float(raw) <= MAX_MS:
                raise SloError(f"{header} is a number of milliseconds in (0, {MAX_MS:.0f}], not {raw[:40]!r}")
            out[what] = float(raw) if out[what] is None else min(out[what], float(raw))
        return out["ttft_ms"], out["atgt_ms"]


def band_shares(classes: Iterable[SloClass]) -> dict[int, float] | None:
    """The bands' minimum shares (band → the largest its classes give), if any class puts its apps outside the
    standard band or gives its band a share; None: the policy runs alone, as without SLO classes."""
    classes = list(classes)
    if all(c.band == "standard" and c.min_share is None for c in classes):
        return None
    shares: dict[int, float] = {}
    for c in classes:
        if c.min_share is not None:
            shares[c.rank] = max(shares.get(c.rank, 0.0), c.min_share)
    return shares


def observed_atgt_s(decode_s: float, tokens: int) -> float:
    """ATGT: the decode time over the tokens after the first (a one-token answer has none: 0)."""
    return decode_s / (tokens - 1) if tokens > 1 else 0.0


def met(ttft_s: float | None, atgt_s: float | None, ttft_ms: float | None, atgt_ms: float | None) -> bool:
    """Both targets met (a target not set is met; a measure that is missing is not)."""
    for value, target in ((ttft_s, ttft_ms), (atgt_s, atgt_ms)):
        if target is not None and (value is None or not math.isfinite(value) or value * 1000.0 > target):
            return False
    return True
