"""``ec_redis.proxy`` against two tiny fake backends (an encoder and PD, stdlib HTTP servers):
call order, the encoder's body rewrite, streaming relay chunk by chunk, errors, health."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ec_redis.embedded import free_port
from ec_redis.proxy import ProxyConfig, make_server

REPO_ROOT = Path(__file__).resolve().parents[1]


class Backend(ThreadingHTTPServer):
    """A fake vLLM server: records every call in the shared ``calls`` list."""

    daemon_threads = True

    def __init__(self, name: str, calls: list[dict[str, Any]]) -> None:
        self.name = name
        self.calls = calls
        self.status = 200  # of POST answers
        self.health_status = 200
        self.gate = threading.Event()  # a streamed answer's second event waits for it
        self.finished = threading.Event()  # set once a streamed answer was sent completely
        super().__init__(("127.0.0.1", 0), BackendHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.gate.set()
        self.shutdown()
        self.server_close()


class BackendHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Backend

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(self.server.health_status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.server.calls.append({"backend": self.server.name, "method": "GET", "path": self.path})
        self._json(200, {"object": "list", "data": [{"id": "tiny", "owned_by": "vllm"}]})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        body = json.loads(raw)
        self.server.calls.append(
            {
                "backend": self.server.name,
                "method": "POST",
                "path": self.path,
                "raw": raw,
                "body": body,
                "authorization": self.headers.get("Authorization"),
                "time": time.monotonic(),
            }
        )
        if self.server.status != 200:
            self._json(self.server.status, {"error": {"message": f"{self.server.name} broke"}})
            return
        if not body.get("stream"):
            self._json(200, {"backend": self.server.name, "tokens": body.get("max_tokens")})
            return
        # Server-sent events, chunked: the second event waits for the test's go-ahead, so
        # the client can only see the first one early if the proxy relays chunk by chunk.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
        for n, event in enumerate(events):
            if n == 1:
                self.server.gate.wait(timeout=10)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.server.finished.set()


@pytest.fixture
def cluster() -> Iterator[dict[str, Any]]:
    """Two encoders, PD and a proxy in front of them (threads in this process)."""
    calls: list[dict[str, Any]] = []
    backends = {name: Backend(name, calls) for name in ("enc1", "enc2", "pd")}
    config = ProxyConfig(
        encoder_urls=(backends["enc1"].url, backends["enc2"].url),
        pd_url=backends["pd"].url,
        encoder_timeout_s=10,
        pd_timeout_s=10,
        health_timeout_s=2,
    )
    proxy = make_server(config, "127.0.0.1", 0)
    thread = threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield {"calls": calls, "port": proxy.server_address[1], **backends}
    finally:
        proxy.shutdown()
        proxy.server_close()
        for backend in backends.values():
            backend.stop()


def request(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 7,
    "temperature": 0,
}


def test_encoder_first_then_pd_with_the_original_body(cluster: dict[str, Any]) -> None:
    body = {**CHAT, "max_completion_tokens": 9}
    status, headers, data = request(
        cluster["port"],
        "POST",
        "/v1/chat/completions",
        body,
        {"Authorization": "Bearer s3cret"},
    )
    assert status == 200, data
    assert json.loads(data) == {"backend": "pd", "tokens": 7}  # PD's answer, relayed
    assert headers["Content-Type"] == "application/json"
    calls = cluster["calls"]
    assert [c["backend"] for c in calls] == ["enc1", "pd"]
    encoder, pd = calls
    assert encoder["path"] == pd["path"] == "/v1/chat/completions"
    assert encoder["body"] == {**body, "max_tokens": 1, "max_completion_tokens": 1, "stream": False}
    assert pd["raw"] == json.dumps(body).encode()  # byte for byte what the client sent
    assert encoder["authorization"] == pd["authorization"] == "Bearer s3cret"
    assert encoder["time"] < pd["time"]


def test_completions_route_and_round_robin(cluster: dict[str, Any]) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
    for _ in range(4):
        status, _, data = request(cluster["port"], "POST", "/v1/completions", body)
        assert status == 200, data
    backends = [c["backend"] for c in cluster["calls"]]
    assert backends == ["enc1", "pd", "enc2", "pd", "enc1", "pd", "enc2", "pd"]
    assert all(c["path"] == "/v1/completions" for c in cluster["calls"])


def test_streaming_is_relayed_chunk_by_chunk(cluster: dict[str, Any]) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", cluster["port"], timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type") == "text/event-stream"
        first = response.read1(65536)
        # PD holds the rest back until now: the first event got through on its own.
        assert first == b'data: {"n": 1}\n\n'
        assert not cluster["pd"].finished.is_set()
        cluster["pd"].gate.set()
        rest = response.read()
    finally:
        conn.close()
    assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'
    encoder, pd = cluster["calls"]
    assert encoder["body"]["stream"] is False and "stream_options" not in encoder["body"]
    assert encoder["body"]["max_tokens"] == 1
    assert pd["body"] == body


def test_encoder_error_is_a_502_and_pd_is_not_asked(cluster: dict[str, Any]) -> None:
    cluster["enc1"].status = 500
    status, headers, data = request(cluster["port"], "POST", "/v1/chat/completions", CHAT)
    assert status == 502
    assert headers["Content-Type"] == "application/json"
    error = json.loads(data)["error"]
    assert error["type"] == "encoder_error" and error["code"] == 502
    assert cluster["enc1"].url in error["message"] and "HTTP 500" in error["message"]
    assert "enc1 broke" in error["message"]
    assert [c["backend"] for c in cluster["calls"]] == ["enc1"]


def test_unreachable_encoder_is_a_502() -> None:
    calls: list[dict[str, Any]] = []
    pd = Backend("pd", calls)
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = make_server(ProxyConfig((dead,), pd.url, encoder_timeout_s=5), "127.0.0.1", 0)
    threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True).start()
    try:
        status, _, data = request(proxy.server_address[1], "POST", "/v1/completions", CHAT)
        health, _, health_data = request(proxy.server_address[1], "GET", "/health")
    finally:
        proxy.shutdown()
        proxy.server_close()
        pd.stop()
    assert status == 502
    error = json.loads(data)["error"]
    assert error["type"] == "encoder_error" and dead in error["message"]
    assert calls == []
    assert health == 503
    report = json.loads(health_data)
    assert report["pd"] == "ok" and report["encoders"][dead] != "ok"


def test_pd_errors_are_relayed_as_they_are(cluster: dict[str, Any]) -> None:
    cluster["pd"].status = 400
    status, _, data = request(cluster["port"], "POST", "/v1/chat/completions", CHAT)
    assert status == 400
    assert json.loads(data) == {"error": {"message": "pd broke"}}


def test_health_needs_pd_and_every_encoder(cluster: dict[str, Any]) -> None:
    status, _, data = request(cluster["port"], "GET", "/health")
    assert status == 200, data
    cluster["enc2"].health_status = 503
    status, _, data = request(cluster["port"], "GET", "/health")
    assert status == 503
    report = json.loads(data)
    assert report["encoders"][cluster["enc2"].url] == "HTTP 503"
    assert report["encoders"][cluster["enc1"].url] == "ok"
    cluster["enc2"].health_status = 200
    cluster["pd"].health_status = 500
    assert request(cluster["port"], "GET", "/health")[0] == 503


def test_models_pass_to_pd(cluster: dict[str, Any]) -> None:
    status, _, data = request(cluster["port"], "GET", "/v1/models")
    assert status == 200
    assert json.loads(data)["data"][0]["id"] == "tiny"
    assert [(c["backend"], c["path"]) for c in cluster["calls"]] == [("pd", "/v1/models")]


def test_bad_requests_never_reach_a_backend(cluster: dict[str, Any]) -> None:
    port = cluster["port"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/completions", b"{not json")
        response = conn.getresponse()
        assert response.status == 400
        assert json.loads(response.read())["error"]["type"] == "invalid_request_error"
    finally:
        conn.close()
    assert request(port, "POST", "/v1/completions", [1, 2])[0] == 400
    assert request(port, "POST", "/v1/embeddings", CHAT)[0] == 404
    assert request(port, "GET", "/metrics")[0] == 404
    assert cluster["calls"] == []


def test_body_limit() -> None:
    calls: list[dict[str, Any]] = []
    enc, pd = Backend("enc", calls), Backend("pd", calls)
    proxy = make_server(ProxyConfig((enc.url,), pd.url, max_body_bytes=100), "127.0.0.1", 0)
    threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True).start()
    try:
        status, _, _ = request(proxy.server_address[1], "POST", "/v1/completions", {"p": "x" * 200})
    finally:
        proxy.shutdown()
        proxy.server_close()
        enc.stop()
        pd.stop()
    assert status == 413
    assert calls == []


def test_command_line_serves_and_stops_on_sigterm(cluster: dict[str, Any]) -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "ec_redis.proxy",
        "--encoder-url", cluster["enc1"].url, "--encoder-url", cluster["enc2"].url,
        "--pd-url", cluster["pd"].url, "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ)
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _, _ = request(port, "GET", "/health")
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, "proxy did not come up"
                time.sleep(0.1)
        assert status == 200
        status, _, data = request(port, "POST", "/v1/chat/completions", CHAT)
        assert status == 200 and json.loads(data)["backend"] == "pd"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
