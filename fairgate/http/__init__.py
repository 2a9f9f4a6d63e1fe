"""fairgate's HTTP/1.1 edge, as a small library that imports nothing of the gateway: a listener (``server.Edge``,
``connection.Connection``, ``routing.Router``, ``messages``) and an upstream client (``client.UpstreamPool``), both
on httptools (llhttp). Why it is fairgate's own and not a maintained server: docs/decisions/0001-own-http-edge.md.

Limits (``server.Limits``; the gateway passes its configuration's), each enforced as bytes arrive:

- head: request line and header fields ≤ ``max_head_bytes`` (16 KiB) and ``max_headers`` (100) fields, else 431;
  a line still arriving counts (httptools holds it; it is refused at the limit plus one 4 KiB slice);
- trailers: the last chunk's trailer section counts with the head (its bytes and its fields), else 431;
- body: ≤ ``max_body_bytes`` (8 MiB), declared or as a chunked body arrives, else 413 (its arrival is timed by
  the handler: the gateway's ``body_timeout_s``);
- pipelining: between requests, bytes are parsed a 4 KiB slice at a time; once a request waits behind the
  running one, the rest of the read is held unparsed and the socket is not read: a connection holds at most one
  read (≤ 256 KiB), one slice's requests and one body;
- write buffer: past ``write_buffer_bytes`` (64 KiB) a stream's writes wait, and the next pipelined request is
  not served until the client has read down to it, within ``write_timeout_s`` (60 s), else the connection drops;
- connections: ``max_connections`` (10,000) in all and ``max_connections_per_client`` (1,000) per client
  address; when either is full a newcomer takes the place of the longest-idle connection that never carried an
  authenticated request (``Request.trust``), else it is refused;
- pace: a connection that never carried an authenticated request is served ``anonymous_rate`` (50) requests a
  second, a burst of as many; its next request waits its turn (a flood of keyless requests, pipelined or not,
  costs the gateway 50 of them a second per connection);
- timeouts: ``header_timeout_s`` (30 s) for a head to arrive, and an authenticated connection's keep-alive idle
  time; ``anonymous_idle_s`` (5 s), the idle time of a connection that never carried an authenticated request;
  closing after an answer lingers ``linger_s`` (2 s) or ``linger_bytes`` (256 KiB), reading and dropping;
- upstream (``UpstreamPool``): a response's head and trailers ≤ 64 KiB and 100 fields as they arrive; its body
  buffered ≤ ``high_water`` (1 MiB) before reading pauses; ``connect_timeout_s``.

RFC 9112 / 9110 rules held to, beyond llhttp's own strict parsing (no obs-fold, no bare CR or LF, one
Content-Length, not both Content-Length and Transfer-Encoding, chunk sizes within 64 bits):

- exactly one ``Host`` in an HTTP/1.1 request, at most one in HTTP/1.0 (RFC 9112 §3.2), else 400;
- ``Transfer-Encoding`` other than a single ``chunked`` → 501 (§6.1); an HTTP version other than 1.1 and 1.0 →
  505 (RFC 9110 §15.6.6);
- ``100 Continue`` only to an HTTP/1.1 request with a body whose handler reads it (RFC 9110 §10.1.1);
- a request asking for a protocol upgrade is served as a plain one, then the connection closes; one with a body
  is refused (400);
- a path is routed as sent, percent-encoding included; only a route's parameter is decoded;
- 405 carries ``Allow`` (RFC 9110 §15.5.6); a 204 or 304 carries no body and a 204 no Content-Length; a 1xx is
  never a final answer;
- a response never carries a header value with a line break (500 instead);
- closing after an answer is a lingering close (RFC 9112 §9.6): FIN after the answer, then what the client still
  sends is read and dropped, so a client still sending a refused body reads its answer instead of a reset.

``tests/test_http_differential.py`` holds the parser to h11's verdicts on generated and known byte streams; its
deliberate differences (all stricter) are listed in ``tests/differential.py``.
"""
