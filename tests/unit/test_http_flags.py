"""The HTTP side of vLLM's server flags: cross-origin requests (--allowed-origins and the rest,
answered as vLLM's Starlette middleware answers them), HTTPS (--ssl-certfile and the rest,
certificates renewed without a restart with --enable-ssl-refresh), and the request log's
outputs (--enable-log-outputs, --enable-log-deltas, --max-log-len), and --root-path."""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from actors.frontend.actor import HttpFrontend
from actors.frontend.app import OpenAIServer, ServerOptions
from actors.frontend.cors import CorsPolicy
from actors.frontend.request_log import OutputLog
from actors.frontend.streams import RequestOutput
from actors.frontend.tls import TlsFiles
from helpers import self_signed_cert
from tools import serve

APP = "https://app.example"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "Authorization, Content-Type"}


async def _answers(policy: CorsPolicy, calls: list[tuple[str, str, dict]], api_key: str | None = "k"):
    server = OpenAIServer(None, ServerOptions(api_key=api_key, cors=policy))
    out = []
    async with TestClient(TestServer(server.app())) as client:
        for method, path, headers in calls:
            async with client.request(method, path, headers=headers) as resp:
                out.append((resp.status, dict(resp.headers), await resp.text()))
    return out


def test_by_default_no_origin_may_read_answers_and_preflights_are_refused():
    (status, headers, text), (status2, headers2, _) = asyncio.run(_answers(CorsPolicy(), [
        ("OPTIONS", "/v1/chat/completions", PREFLIGHT), ("GET", "/health", {"Origin": APP})]))
    assert (status, text) == (400, "Disallowed CORS origin") and "Access-Control-Allow-Origin" not in headers
    assert status2 == 503 and "Access-Control-Allow-Origin" not in headers2 and headers2["Vary"] == "Origin"


def test_an_allowed_origin_gets_its_preflight_without_the_key_and_every_answer_names_it():
    policy = CorsPolicy(allowed_origins=(APP,))
    pre, models, other, plain = asyncio.run(_answers(policy, [
        ("OPTIONS", "/v1/chat/completions", PREFLIGHT),          # no key: a browser sends none with it
        ("GET", "/v1/models", {"Origin": APP}),                  # 401, readable by the page
        ("GET", "/health", {"Origin": "https://other.example"}),
        ("GET", "/health", {})]))
    status, headers, text = pre
    assert (status, text) == (200, "OK")
    assert headers["Access-Control-Allow-Origin"] == APP
    assert headers["Access-Control-Allow-Headers"] == "Authorization, Content-Type"   # "*": echoed
    assert headers["Access-Control-Allow-Methods"] == "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
    assert headers["Access-Control-Max-Age"] == "600"
    assert models[0] == 401 and models[1]["Access-Control-Allow-Origin"] == APP and models[1]["Vary"] == "Origin"
    assert "Access-Control-Allow-Origin" not in other[1]
    assert "Access-Control-Allow-Origin" not in plain[1] and "Vary" not in plain[1]


def test_any_origin_is_a_star_unless_credentials_need_the_origin_itself():
    star = asyncio.run(_answers(CorsPolicy(allowed_origins=("*",)), [
        ("OPTIONS", "/v1/completions", PREFLIGHT), ("GET", "/health", {"Origin": APP})]))
    assert star[0][1]["Access-Control-Allow-Origin"] == "*" and star[1][1]["Access-Control-Allow-Origin"] == "*"
    creds = asyncio.run(_answers(CorsPolicy(allowed_origins=("*",), allow_credentials=True), [
        ("OPTIONS", "/v1/completions", PREFLIGHT), ("GET", "/health", {"Origin": APP})]))
    for _, headers, _ in creds:
        assert headers["Access-Control-Allow-Origin"] == APP
        assert headers["Access-Control-Allow-Credentials"] == "true"


def test_methods_and_headers_outside_the_lists_fail_the_preflight_naming_them():
    policy = CorsPolicy(allowed_origins=(APP,), allowed_methods=("GET", "POST"), allowed_headers=("Authorization",))
    ok, bad_method, bad_header = asyncio.run(_answers(policy, [
        ("OPTIONS", "/v1/models", {**PREFLIGHT, "Access-Control-Request-Headers": "authorization, content-type"}),
        ("OPTIONS", "/v1/models", {**PREFLIGHT, "Access-Control-Request-Method": "DELETE"}),
        ("OPTIONS", "/v1/models", {**PREFLIGHT, "Access-Control-Request-Headers": "X-Secret"})]))
    assert ok[0] == 200 and ok[1]["Access-Control-Allow-Methods"] == "GET, POST"
    assert ok[1]["Access-Control-Allow-Headers"] == "Accept, Accept-Language, Authorization, Content-Language, Content-Type"
    assert (bad_method[0], bad_method[2]) == (400, "Disallowed CORS method")
    assert (bad_header[0], bad_header[2]) == (400, "Disallowed CORS headers")


def test_the_cors_flags_take_vllms_json_lists(capsys):
    args = serve.parse_args(["--allowed-origins", '["https://a.example", "https://b.example"]',
                             "--allowed-methods", '["GET"]', "--allow-credentials"])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == \
        (["https://a.example", "https://b.example"], ["GET"], ["*"], True)
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):
            serve.parse_args(["--allowed-origins", bad])
        assert "--allowed-origins" in capsys.readouterr().err


# -- HTTPS -------------------------------------------------------------------------------------

def test_tls_flags_that_cannot_serve_are_refused_naming_what_is_missing(tmp_path, capsys):
    cert, key = self_signed_cert(str(tmp_path))
    for argv, message in ((["--ssl-keyfile", key], "--ssl-keyfile needs --ssl-certfile"),
                          (["--ssl-certfile", cert, "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
                          (["--ssl-certfile", cert, "--ssl-cert-reqs", "5"], "0 (none), 1 (optional) or 2"),
                          (["--enable-ssl-refresh"], "--enable-ssl-refresh needs --ssl-certfile")):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot load"):
        TlsFiles.of(key, str(tmp_path / "missing.pem")).context()
    with pytest.raises(ValueError, match="--ssl-ciphers 'NOPE'"):
        TlsFiles.of(key, cert, ciphers="NOPE").context()


def _peer_cert(port: int, ca: str) -> bytes:
    ctx = ssl.create_default_context(cafile=ca)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            return s.getpeercert(binary_form=True)


async def _serve_and_renew(tmp_path) -> tuple[int, int, int]:
    """Serve HTTPS with one certificate and renew its files in place: the status of an HTTPS
    request, of a plain HTTP one (0: refused), and 1 once the new certificate was served."""
    old_cert, old_key = self_signed_cert(str(tmp_path), "old")
    new_cert, new_key = self_signed_cert(str(tmp_path), "new")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(open(old_cert, "rb").read())
    key.write_bytes(open(old_key, "rb").read())
    files = TlsFiles.of(str(key), str(cert))
    frontend = HttpFrontend(OpenAIServer(None, ServerOptions()), "127.0.0.1", 0, files.context(), files)
    await frontend.started()
    try:
        port = frontend.port
        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://127.0.0.1:{port}/health",
                                   ssl=ssl.create_default_context(cafile=old_cert)) as resp:
                status = resp.status
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                    plain = resp.status
            except aiohttp.ClientError:
                plain = 0
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, _peer_cert, port, old_cert)
        # a renewal writes the key, then the certificate: while the pair does not match, the old
        # certificate keeps serving
        key.write_bytes(open(new_key, "rb").read())
        await asyncio.sleep(1.5)           # past the watcher's next look (every second)
        assert await loop.run_in_executor(None, _peer_cert, port, old_cert)
        cert.write_bytes(open(new_cert, "rb").read())
        deadline = time.monotonic() + 15
        while True:
            try:
                await loop.run_in_executor(None, _peer_cert, port, new_cert)
                break
            except ssl.SSLError:
                assert time.monotonic() < deadline, "the renewed certificate was never served"
                await asyncio.sleep(0.2)
        return status, plain, 1
    finally:
        await frontend.stopped()


def test_https_serves_the_certificate_and_a_renewed_one_without_a_restart(tmp_path):
    status, plain, renewed = asyncio.run(_serve_and_renew(tmp_path))
    assert status == 503            # the model is loading: but the answer came over TLS
    assert plain != 200             # no plain HTTP on an HTTPS port
    assert renewed == 1


# -- the request log's outputs ------------------------------------------------------------------

def test_log_outputs_writes_each_finished_output_once_clipped_to_max_log_len(caplog):
    with caplog.at_level(logging.DEBUG, logger="troupe.http"):
        out = OutputLog("req-1", 8)
        out.take(RequestOutput("req-1", "Hello", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
        out.take(RequestOutput("req-1", ", world", [10], finished=True, finish_reason="stop"))
        OutputLog("req-2", None).take(RequestOutput("req-2", "partial", [1], finished=True,
                                                    finish_reason="error", error="boom"))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [("DEBUG", "response req-1: output_token_ids: [1, 2, 3, 4, 5, 6, 7, 8]"),
                     ("INFO", "response req-1: output: 'Hello, w', finish_reason: stop"),
                     ("DEBUG", "response req-2: output_token_ids: [1]"),
                     ("INFO", "response req-2: output: 'partial', finish_reason: error (boom)")]


def test_a_streamed_request_logs_each_delta_unless_deltas_are_off(caplog):
    def lines(deltas: bool) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="troupe.http"):
            out = OutputLog("req-3", 5, deltas)
            out.streaming = True
            out.take(RequestOutput("req-3", "Hello", [1]))
            out.take(RequestOutput("req-3", "", [2]))           # no text yet: no line
            out.take(RequestOutput("req-3", " there", [3], finished=True, finish_reason="stop"))
        return [r.getMessage() for r in caplog.records]
    assert lines(True) == ["response req-3 (streaming delta): output: 'Hello', finish_reason: None",
                           "response req-3 (streaming delta): output: ' ther', finish_reason: stop",
                           "response req-3 (streaming complete): output: 'Hello', finish_reason: stop"]
    assert lines(False) == ["response req-3 (streaming complete): output: 'Hello', finish_reason: stop"]


def test_under_a_root_path_every_endpoint_answers_there_too_with_the_same_key_checks(capsys):
    """vLLM's --root-path (the server behind a proxy that serves it under a path): /api/health
    is /health, /api/v1/... needs the key as /v1/... does; nothing else under /api exists."""
    async def answers():
        server = OpenAIServer(None, ServerOptions(api_key="k", root_path="/api"))
        out = {}
        async with TestClient(TestServer(server.app())) as client:
            for path, headers in (("/health", {}), ("/api/health", {}), ("/api/v1/models", {}),
                                  ("/api/v1/models", {"Authorization": "Bearer k"}), ("/api/nothing", {}),
                                  ("/apis/health", {}), ("/api/dashboard", {})):
                async with client.get(path, headers=headers) as resp:
                    out.setdefault(path, []).append(resp.status)
        return out
    got = asyncio.run(answers())
    assert got == {"/health": [503], "/api/health": [503], "/api/v1/models": [401, 503],   # 503: no model yet
                   "/api/nothing": [404], "/apis/health": [404], "/api/dashboard": [401]}
    assert serve.parse_args(["--root-path", "/api/"]).root_path == "/api"
    with pytest.raises(SystemExit):
        serve.parse_args(["--root-path", "api"])
    assert "--root-path" in capsys.readouterr().err


# -- --api-key ---------------------------------------------------------------------------------

def test_any_of_several_api_keys_opens_v1_as_bearer_or_x_api_key_and_vllm_api_key_is_the_default(monkeypatch):
    async def statuses():
        server = OpenAIServer(None, ServerOptions(api_key=("k1", "k2")))
        out = []
        async with TestClient(TestServer(server.app())) as client:
            for auth in ("Bearer k1", "bearer k2", "Bearer k3", "k1", ""):
                async with client.get("/v1/models", headers={"Authorization": auth} if auth else {}) as resp:
                    out.append(resp.status)
            for key in ("k2", "k3"):             # the Anthropic SDK's header
                async with client.post("/v1/messages", headers={"X-Api-Key": key}, json={}) as resp:
                    out.append(resp.status)
            async with client.get("/dashboard?api_key=k2") as resp:
                out.append((resp.status, resp.cookies["troupe_api_key"].value))
        return out
    assert asyncio.run(statuses()) == [503, 503, 401, 401, 401, 503, 401, (200, "k2")]   # 503: loading, past the key
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert serve.parse_args([]).api_key == ("from-env",)
    assert serve.parse_args(["--api-key", "a", "b"]).api_key == ("a", "b")
    monkeypatch.delenv("VLLM_API_KEY")
    assert serve.parse_args([]).api_key is None


# -- --uds -------------------------------------------------------------------------------------

def test_uds_serves_on_a_unix_socket_and_removes_it_when_stopped(tmp_path):
    path = str(tmp_path / "troupe.sock")

    async def serve_once():
        frontend = HttpFrontend(OpenAIServer(None, ServerOptions()), "127.0.0.1", 0, uds=path)
        await frontend.started()
        try:
            address = await frontend.receive(None)
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
                async with session.get("http://localhost/health") as resp:
                    return address.url, resp.status
        finally:
            await frontend.stopped()
    assert asyncio.run(serve_once()) == (f"unix:{path}", 503)      # 503: no model loaded
    import os
    assert not os.path.exists(path)
    assert serve.parse_args(["--uds", path]).uds == path


# -- logging -----------------------------------------------------------------------------------

def test_a_log_config_file_that_cannot_configure_logging_stops_the_command_naming_it(tmp_path, capsys):
    import json as _json
    for text, why in (("{", "not valid JSON"), ("[1]", 'expected a logging dictConfig object with a "version" key'),
                      (None, "No such file or directory")):
        path = tmp_path / "logging.json"
        if text is None:
            path = tmp_path / "missing.json"
        else:
            path.write_text(text)
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(["--log-config-file", str(path)])
        assert exc.value.code == 2 and f"--log-config-file {path}: {why}" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(_json.dumps({"version": 1}))
    assert serve.parse_args(["--log-config-file", str(good)]).log_config_file == str(good)
    assert serve.parse_args(["--disable-access-log-for-endpoints", "/health,/metrics"]).log_level == "INFO"


async def stamp_middleware(request: web.Request, handler) -> web.StreamResponse:
    """A plain coroutine function (no @web.middleware): every answer it sees gets a header."""
    response = await handler(request)
    response.headers["X-Stamped"] = "1"
    return response


class TeapotMiddleware:
    """A class: its instance answers /version itself."""

    async def __call__(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path == "/version":
            return web.Response(status=418, text="teapot")
        return await handler(request)


def test_middleware_flag_adds_aiohttp_middlewares_inside_the_servers_own(capsys):
    """vLLM's --middleware (by import path, repeatable): a function or a class's instance wraps
    every endpoint, after the API key check (a refused request never reaches it)."""
    args = serve.parse_args(["--middleware", f"{__name__}.stamp_middleware",
                             "--middleware", f"{__name__}:TeapotMiddleware"])

    async def main():
        server = OpenAIServer(None, ServerOptions(api_key=("k",), middleware=args.middleware))
        async with TestClient(TestServer(server.app())) as client:
            out = []
            for path, headers in (("/health", {}), ("/version", {}), ("/v1/models", {})):
                async with client.get(path, headers=headers) as resp:
                    out.append((resp.status, resp.headers.get("X-Stamped"), await resp.text()))
            return out
    health, version, refused = asyncio.run(main())
    assert health[:2] == (503, "1")                  # loading: the server's answer, stamped
    assert version == (418, "1", "teapot")
    assert refused[:2] == (401, None)
    for path, words in (("no_such_module.mw", "cannot be imported"), ("json.dumps", "not an aiohttp middleware")):
        with pytest.raises(SystemExit):
            serve.parse_args(["--middleware", path])
        assert words in capsys.readouterr().err
