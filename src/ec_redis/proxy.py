"""A small encoder → prefill/decode proxy for vLLM's encoder disaggregation (E + PD).

``python -m ec_redis.proxy --encoder-url http://encoder:8000 --pd-url http://pd:8000``

Each ``POST /v1/chat/completions`` or ``/v1/completions`` goes to an encoder first
(round-robin over the ``--encoder-url`` flags) with ``max_tokens=1`` and ``stream=false``,
and the proxy waits for its answer: the encoder has then computed the request's multimodal
embeddings and handed them to its EC connector (ec_redis writes them to Redis). Then the
original body goes to PD, whose answer is relayed as it comes, chunk by chunk when PD streams
(``text/event-stream``). An encoder that fails or cannot be reached turns into a 502 with a
JSON error; PD is then not asked. ``GET /v1/models`` is PD's; ``GET /health`` is 200 only
when PD and every encoder answer their ``/health``.

This is the simple flow of vLLM's ``disagg_epd_proxy.py`` (the raw media go to PD, which
hashes them to the same ``mm_hash`` as the encoder did). Standard library only; every
upstream call has a timeout, and request and response bodies are bounded or streamed.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, cast
from urllib.parse import urlsplit

log = logging.getLogger("ec_redis.proxy")

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
# Request headers passed on to the encoder and to PD (Content-Type and length are set here).
FORWARDED_HEADERS = ("authorization", "x-request-id", "accept")
# Response headers that belong to one hop, never relayed as they are.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "server",  # these two are this hop's own (send_response writes them)
        "date",
    }
)
ERROR_SNIPPET_BYTES = 64 << 10


@dataclass(frozen=True)
class Upstream:
    """One backend server, from its base URL (``http[s]://host[:port][/prefix]``)."""

    url: str

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {self.url!r} (e.g. http://encoder:8000)")

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        assert parts.hostname is not None
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return cls(parts.hostname, parts.port, timeout=timeout_s)

    def target(self, path: str) -> str:
        return urlsplit(self.url).path.rstrip("/") + path


@dataclass(frozen=True)
class ProxyConfig:
    encoder_urls: tuple[str, ...]
    pd_url: str
    encoder_timeout_s: float = 300.0  # per socket operation on an encoder call
    pd_timeout_s: float = 600.0  # per socket operation while relaying PD (gap between chunks)
    health_timeout_s: float = 5.0
    client_timeout_s: float = 600.0  # per socket operation with the client
    max_body_bytes: int = 256 << 20  # a request with large data-URL images stays well below
    chunk_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if not self.encoder_urls:
            raise ValueError("at least one encoder URL is needed")
        for url in (*self.encoder_urls, self.pd_url):
            Upstream(url)


class UpstreamError(Exception):
    """A backend could not be reached or answered with an error."""


def encoder_request(request: dict[str, Any]) -> dict[str, Any]:
    """The encoder's copy of a request: one token at most, no streaming."""
    out = dict(request)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)  # vLLM refuses stream_options without stream
    return out


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], config: ProxyConfig) -> None:
        self.config = config
        self.encoders = [Upstream(u) for u in config.encoder_urls]
        self.pd = Upstream(config.pd_url)
        self._next = itertools.cycle(range(len(self.encoders)))
        self._lock = threading.Lock()
        super().__init__(address, ProxyHandler)

    def next_encoder(self) -> Upstream:
        with self._lock:
            return self.encoders[next(self._next)]


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ec_redis-proxy"

    @property
    def proxy(self) -> ProxyServer:
        return cast(ProxyServer, self.server)

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.proxy.config.client_timeout_s)

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    # -- routes -----------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/health":
            self._health()
        elif path == "/v1/models":
            self._relay_pd("GET", None)
        else:
            self._send_error(404, f"no route GET {path}", "not_found")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path not in GENERATE_PATHS:
            self._send_error(404, f"no route POST {path}", "not_found")
            return
        body = self._read_body()
        if body is None:
            return
        try:
            request = json.loads(body)
        except ValueError as exc:
            self._send_error(400, f"the body is not JSON: {exc}", "invalid_request_error")
            return
        if not isinstance(request, dict):
            self._send_error(400, "the body must be a JSON object", "invalid_request_error")
            return
        encoder = self.proxy.next_encoder()
        try:
            self._call_encoder(encoder, json.dumps(encoder_request(request)).encode())
        except UpstreamError as exc:
            log.warning("%s", exc)
            self._send_error(502, str(exc), "encoder_error")
            return
        self._relay_pd("POST", body)

    # -- pieces -----------------------------------------------------------------------------

    def _read_body(self) -> bytes | None:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self.close_connection = True
            self._send_error(411, "a Content-Length header is required", "invalid_request_error")
            return None
        try:
            length = int(length_header)
            if length < 0:
                raise ValueError(length_header)
        except ValueError:
            self.close_connection = True
            self._send_error(400, "bad Content-Length", "invalid_request_error")
            return None
        if length > self.proxy.config.max_body_bytes:
            self.close_connection = True  # the body stays unread
            self._send_error(
                413,
                f"body of {length} bytes exceeds --max-body-bytes "
                f"{self.proxy.config.max_body_bytes}",
                "invalid_request_error",
            )
            return None
        return self.rfile.read(length)

    def _forward_headers(self, body: bytes | None) -> dict[str, str]:
        headers = {k: v for k in FORWARDED_HEADERS if (v := self.headers.get(k)) is not None}
        if body is not None:
            headers["Content-Type"] = "application/json"
            headers["Content-Length"] = str(len(body))
        return headers

    def _call_encoder(self, encoder: Upstream, body: bytes) -> None:
        """POST to the encoder and wait for its whole answer; UpstreamError unless 2xx."""
        path = urlsplit(self.path).path
        conn = encoder.connect(self.proxy.config.encoder_timeout_s)
        try:
            conn.request("POST", encoder.target(path), body, self._forward_headers(body))
            response = conn.getresponse()
            # The answer itself is not needed; read a bounded part of it (for errors).
            data = response.read(ERROR_SNIPPET_BYTES)
            if not 200 <= response.status < 300:
                raise UpstreamError(
                    f"encoder {encoder.url} answered HTTP {response.status}: {_message(data)}"
                )
        except (OSError, http.client.HTTPException) as exc:
            raise UpstreamError(
                f"encoder {encoder.url} failed: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            conn.close()

    def _relay_pd(self, method: str, body: bytes | None) -> None:
        pd = self.proxy.pd
        config = self.proxy.config
        conn = pd.connect(config.pd_timeout_s)
        try:
            try:
                conn.request(method, pd.target(self.path), body, self._forward_headers(body))
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                message = f"PD {pd.url} failed: {type(exc).__name__}: {exc}"
                log.warning("%s", message)
                self._send_error(502, message, "pd_error")
                return
            self.send_response(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in HOP_BY_HOP:
                    self.send_header(name, value)
            length = response.getheader("Content-Length")
            try:
                if length is not None and length.isdigit():
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    for piece in _pieces(response, config.chunk_bytes, whole=True):
                        self.wfile.write(piece)
                else:  # streamed (SSE) or close-delimited: relay each piece as it arrives
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for piece in _pieces(response, config.chunk_bytes, whole=False):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (OSError, http.client.HTTPException) as exc:
                # The client left or PD broke off mid-answer: nothing more can be said on
                # this connection. Closing PD's connection makes vLLM abort the request.
                log.warning("relaying PD's answer stopped: %s: %s", type(exc).__name__, exc)
                self.close_connection = True
        finally:
            conn.close()

    def _health(self) -> None:
        timeout_s = self.proxy.config.health_timeout_s
        pd = _probe(self.proxy.pd, timeout_s)
        encoders = {e.url: _probe(e, timeout_s) for e in self.proxy.encoders}
        healthy = pd == "ok" and all(v == "ok" for v in encoders.values())
        self._send_json(200 if healthy else 503, {"pd": pd, "encoders": encoders})

    def _send_error(self, status: int, message: str, kind: str) -> None:
        self._send_json(status, {"error": {"message": message, "type": kind, "code": status}})

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            self.close_connection = True


def _pieces(response: http.client.HTTPResponse, size: int, whole: bool) -> Iterator[bytes]:
    """The response body in pieces of at most ``size`` bytes. ``whole=False`` yields what
    has arrived without waiting for a full piece (``read1``), for streamed answers."""
    while True:
        piece = response.read(size) if whole else response.read1(size)
        if not piece:
            return
        yield piece


def _probe(upstream: Upstream, timeout_s: float) -> str:
    conn = upstream.connect(timeout_s)
    try:
        conn.request("GET", upstream.target("/health"))
        response = conn.getresponse()
        response.read(ERROR_SNIPPET_BYTES)
        return "ok" if response.status == 200 else f"HTTP {response.status}"
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def _message(data: bytes) -> str:
    """The error message of an OpenAI-style JSON error body, else the body's start."""
    text = data.decode("utf-8", errors="replace")
    try:
        payload = json.loads(text)
        error = payload.get("error", payload) if isinstance(payload, dict) else payload
        message = error.get("message", error) if isinstance(error, dict) else error
        text = message if isinstance(message, str) else json.dumps(message)
    except ValueError:
        pass
    return text[:500] or "(empty body)"


def make_server(config: ProxyConfig, host: str = "127.0.0.1", port: int = 8000) -> ProxyServer:
    """A bound proxy server (port 0: any free port; see ``server_address``)."""
    return ProxyServer((host, port), config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ec_redis.proxy",
        description="Send each completion request to an encoder first, then to PD.",
    )
    parser.add_argument(
        "--encoder-url",
        action="append",
        required=True,
        help="an encoder server's base URL; repeat for several (round-robin)",
    )
    parser.add_argument("--pd-url", required=True, help="the prefill/decode server's base URL")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--encoder-timeout-s", type=float, default=300.0)
    parser.add_argument("--pd-timeout-s", type=float, default=600.0)
    parser.add_argument("--max-body-bytes", type=int, default=256 << 20)
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = ProxyConfig(
        encoder_urls=tuple(args.encoder_url),
        pd_url=args.pd_url,
        encoder_timeout_s=args.encoder_timeout_s,
        pd_timeout_s=args.pd_timeout_s,
        max_body_bytes=args.max_body_bytes,
    )
    server = make_server(config, args.host, args.port)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)  # PID 1 in a container ignores SIGTERM without a handler

    signal.signal(signal.SIGTERM, stop)
    log.info(
        "listening on %s:%d; encoders %s; PD %s",
        args.host,
        server.server_address[1],
        ", ".join(config.encoder_urls),
        config.pd_url,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
