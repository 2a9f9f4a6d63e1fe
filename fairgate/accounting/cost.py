"""Cost functions h(n_p, n_q): what serving n_p input and n_q output tokens costs a client (VTC §3.1, §4.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class CostFunction(Protocol):
    name: str
    per_output_token: float | None  # what each output token adds whatever n_p and n_q (None: it depends)

    def h(self, n_p: float, n_q: float) -> float:
        ...

    def delta(self, n_p: float, n_q: float, n_q_after: float) -> float:
        """h(n_p, n_q_after) − h(n_p, n_q): what output tokens n_q … n_q_after add (charged as they stream)."""
        ...


@dataclass(frozen=True, slots=True)
class LinearCost:
    """W = w_p·n_p + w_q·n_q. ``tokens`` is (1, 1); ``weighted`` is (1, 2), the paper's evaluation (§5.1)."""

    name: str = "weighted"
    w_p: float = 1.0
    w_q: float = 2.0

    def h(self, n_p: float, n_q: float) -> float:
        return self.w_p * n_p + self.w_q * n_q

    def delta(self, n_p: float, n_q: float, n_q_after: float) -> float:
        return self.w_q * (n_q_after - n_q)

    @property
    def per_output_token(self) -> float:
        return self.w_q


@dataclass(frozen=True, slots=True)
class ProfileCost:
    """The profiled quadratic cost of App. B.2, in ms per request as the artifact fits it:
    h = 0.21·n_p + 0.10·n_q + 0.0040·n_p·n_q + 0.0032·n_q² + 1.15 (the paper prints it ×10, in 0.1 ms)."""

    name: str = "profile"

    def h(self, n_p: float, n_q: float) -> float:
        return (0.21001891 * n_p + 0.10075395 * n_q + 0.0039868 * n_p * n_q + 0.00324733 * n_q * n_q
                + 1.14601454)

    def delta(self, n_p: float, n_q: float, n_q_after: float) -> float:
        return self.h(n_p, n_q_after) - self.h(n_p, n_q)

    per_output_token = None


def make_cost(name: str, w_p: float = 1.0, w_q: float = 2.0) -> CostFunction:
    if name == "tokens":
        return LinearCost("tokens", 1.0, 1.0)
    if name == "weighted":
        return LinearCost("weighted", w_p, w_q)
    if name == "profile":
        return ProfileCost()
    raise ValueError(f"unknown cost function {name!r}; known: tokens, weighted, profile")
