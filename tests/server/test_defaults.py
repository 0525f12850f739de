"""Safer defaults: the API key from the environment or a file and a Bearer scheme in any case;
JSON bodies only; without a key, loopback and allowed Host names only; no versions in `Server`;
every error of the HTTP layer an OpenAI error body; a body that does not arrive in time is a 408;
requests that can never succeed are 400s naming the field."""

from __future__ import annotations

import json
import socket
import time

import pytest

from kipp_core.cli.serve import api_key, build_parser
from kipp_core.server.context import ServerConfig
from tests.server.conftest import Http, assert_error_body, start_server
from tests.server.test_faults import read_until

KEY = "sekret"


@pytest.fixture(scope="module")
def keyed(tiny_path):
    config = ServerConfig(port=0, api_key=KEY, max_body_bytes=4096, body_timeout=0.5)
    st = start_server(tiny_path, config, max_waiting=4)
    yield st
    st.stop()


def raw(url: str, data: bytes, until: bytes = b"}}") -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(data)
        return read_until(s, until)


def post(path: str, body: bytes, headers: dict) -> bytes:
    h = {"Host": "127.0.0.1", "Content-Length": str(len(body)), **headers}
    return (
        f"POST {path} HTTP/1.1\r\n".encode()
        + "".join(f"{k}: {v}\r\n" for k, v in h.items()).encode()
        + b"\r\n"
        + body
    )


def error_of(response: bytes) -> tuple[int, dict, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_api_key_from_the_environment_or_a_file(tmp_path, monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.setenv("KIPP_API_KEY", "from-env")
    assert api_key(parse([])) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert api_key(parse(["--api-key-file", str(f)])) == "from-file"
    assert api_key(parse(["--api-key", "flag", "--api-key-file", str(f)])) == "flag"
    monkeypatch.delenv("KIPP_API_KEY")
    assert api_key(parse([])) is None


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_in_any_case(keyed, scheme):
    status, _, _ = Http(keyed.url).get("/v1/models", {"Authorization": f"{scheme} {KEY}"})
    assert status == 200


def test_json_bodies_only(keyed):
    h = Http(keyed.url)
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, err = h.post("/v1/completions", body, {**auth, "Content-Type": "text/plain"})
    assert status == 415 and assert_error_body(err)["code"] == "unsupported_media_type"
    ok = {**auth, "Content-Type": "application/json; charset=utf-8"}
    assert h.post("/v1/completions", body, ok)[0] == 200


def test_without_a_key_only_loopback_and_allowed_hosts(tiny_path):
    config = ServerConfig(port=0, allowed_hosts=("kipp.internal",))
    st = start_server(tiny_path, config)
    try:
        h = Http(st.url)
        for host, want in [
            ("evil.example", 403),
            ("evil.example:8000", 403),
            ("127.0.0.1:1", 200),
            ("localhost", 200),
            ("[::1]:80", 200),
            ("kipp.internal", 200),
        ]:
            status, _, body = h.get("/v1/models", {"Host": host})
            assert status == want, host
            if want == 403:
                assert assert_error_body(body)["code"] == "host_not_allowed"
        assert h.get("/health", {"Host": "evil.example"})[0] == 200  # probes need no Host
    finally:
        st.stop()


def test_with_a_key_any_host(keyed):
    headers = {"Host": "evil.example", "Authorization": f"Bearer {KEY}"}
    assert Http(keyed.url).get("/v1/models", headers)[0] == 200


def test_no_versions_in_the_server_header(keyed):
    _, headers, _ = Http(keyed.url).get("/health")
    assert headers["Server"] == "kipp"


def test_a_malformed_request_is_an_openai_error_without_the_request_bytes(keyed):
    status, headers, body = error_of(raw(keyed.url, b"GET /\x01secret HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    assert "secret" not in assert_error_body(body)["message"]
    assert headers["Server"] == "kipp"


def test_expect_100_continue_over_the_limit_is_413(keyed):
    headers = {
        "Content-Type": "application/json",
        "Content-Length": "999999",
        "Expect": "100-continue",
        "Authorization": f"Bearer {KEY}",
    }
    response = raw(keyed.url, post("/v1/completions", b"", headers))
    assert not response.startswith(b"HTTP/1.1 100")
    status, _, body = error_of(response)
    assert status == 413 and assert_error_body(body)


def test_a_body_that_does_not_decode_is_400(keyed):
    headers = {
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "Authorization": f"Bearer {KEY}",
    }
    status, _, body = error_of(raw(keyed.url, post("/v1/completions", b"not gzip", headers)))
    assert status == 400 and "gzip" in assert_error_body(body)["message"]


def test_a_stalled_body_is_408(keyed):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    data = post("/v1/completions", b'{"prom', {**headers, "Content-Length": "100"})
    t = time.monotonic()
    status, _, body = error_of(raw(keyed.url, data))
    assert status == 408 and assert_error_body(body)
    assert time.monotonic() - t < 5  # the body timeout is 0.5 s


def test_n_above_the_waiting_queue_is_400(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, body = Http(keyed.url).post("/v1/completions", {"prompt": "x", "n": 8}, auth)
    assert status == 400 and assert_error_body(body)["param"] == "n"


def test_min_tokens_beyond_the_context_is_400(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {"messages": [{"role": "user", "content": "x"}], "min_tokens": 10**9}
    status, _, body = Http(keyed.url).post("/v1/chat/completions", chat, auth)
    assert status == 400 and assert_error_body(body)["param"] == "min_tokens"
