"""The KV a request holds on its backend while it runs (docs/operations/configuration.md#reservation): its
prompt and the output it will likely produce (``reserve: predicted``, the ``reserve_quantile`` of the outputs
seen for its app, stage and prompt length: accounting/length.py), grown as a stream outlives it, or all it may
produce (``reserve: max_tokens``, and whenever nothing better is known). Never more than n full contexts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fairgate.accounting.length import OutputLengths

if TYPE_CHECKING:
    from fairgate.proxy.call import Attempt, Call
    from fairgate.proxy.config import GatewayConfig
    from fairgate.proxy.pipeline.dispatcher import Dispatcher
    from fairgate.proxy.pipeline.validate import ParsedRequest

DEFAULT_OUTPUT_RESERVATION = 256  # output tokens reserved for a request whose max_tokens the client left open


class Reservations:
    def __init__(self, config: GatewayConfig, dispatcher: Dispatcher, lengths: OutputLengths):
        self.config, self.dispatcher, self.lengths = config, dispatcher, lengths

    @staticmethod
    def most(call: Call, parsed: ParsedRequest) -> int:
        """All the output the request may produce (every choice of every prompt): max_tokens each, or without
        one the rest of the model's context after its prompt (256 if that is unknown)."""
        if parsed.max_tokens is not None:
            return call.n * parsed.max_tokens
        if parsed.context_limit is None:
            return call.n * DEFAULT_OUTPUT_RESERVATION
        return call.n * max(1, parsed.context_limit - call.tally.estimated_prompt // call.prompts)

    @staticmethod
    def kv(call: Call, parsed: ParsedRequest, output: int) -> int:
        """KV tokens a request holding ``output`` tokens of output uses: never more than n full contexts."""
        kv_tokens = call.tally.estimated_prompt + output
        return kv_tokens if parsed.context_limit is None else min(kv_tokens, call.n * parsed.context_limit)

    def initial(self, call: Call, parsed: ParsedRequest, whole: bool) -> int:
        """The output tokens a request reserves at dispatch: predicted for a streaming client; all it may produce
        for an answer with no progress to grow by (whole, or collected for a non-streaming client from a backend
        that may not report running usage), or 256 per choice without a max_tokens (as before: growth follows)."""
        most = call.max_output = self.most(call, parsed)
        call.output_capped = parsed.max_tokens is not None or parsed.context_limit is not None
        if whole or not parsed.stream or self.config.reserve != "predicted":
            return most if parsed.max_tokens is not None else min(most, call.n * DEFAULT_OUTPUT_RESERVATION)
        likely = self.lengths.upper(call.app, call.stage, call.tally.estimated_prompt // call.prompts,
                                    self.config.reserve_quantile)
        return most if likely is None else min(most, call.n * likely)

    def charge(self, call: Call, parsed: ParsedRequest, d: Attempt) -> None:
        """Charge what the stream generated so far; grow its reservation once it passed it, to what such a request
        goes on to (Aladdin's re-prediction E[L | L > l], at the quantile), else to all it may still produce."""
        generated = call.tally.completion_tokens
        self.dispatcher.charge(d.ticket, generated)
        if generated <= d.reserved_output:
            return
        most = self.most(call, parsed)
        beyond = self.lengths.upper_beyond(call.app, call.stage, call.tally.estimated_prompt // call.prompts,
                                           -(-generated // call.n), self.config.reserve_quantile)
        d.reserved_output = most if beyond is None else min(most, max(call.n * beyond, generated))
        self.dispatcher.reserve(d.ticket, d.backend, self.kv(call, parsed, d.reserved_output))
