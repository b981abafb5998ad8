"""`flared run --ssl-certfile/--ssl-keyfile` (config ssl_certfile, ssl_keyfile): the API over HTTPS, as vLLM serves it.

The certificate is a self-signed P-256 one for 127.0.0.1 and localhost, valid until 2126, made with
`openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 36500 -subj /CN=127.0.0.1
-addext subjectAltName=IP:127.0.0.1,DNS:localhost`: test material only."""

from __future__ import annotations

import http.client
import json
import ssl
import time

import anthropic
import httpx
import openai
import pytest
from flared_testing.daemon import Daemon

from flared.config import ConfigError, ServerConfig

CERT = """-----BEGIN CERTIFICATE-----
MIIBnDCCAUGgAwIBAgIUT6u80RK6wZLJx5meQK4nNxVdj+owCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJMTI3LjAuMC4xMCAXDTI2MTIwMjEwMjYyNloYDzIxMjYxMTA4
MTAyNjI2WjAUMRIwEAYDVQQDDAkxMjcuMC4wLjEwWTATBgcqhkjOPQIBBggqhkjO
PQMBBwNCAATfkWu2VdHENO+vcl1v4urRaHr+9PKH9oQ6zr1arU7Pdb+ToL03RwdZ
kOAsICYoVz0dQqk37qMNWqclNTnkyQwro28wbTAdBgNVHQ4EFgQUe+1G6OC7dLny
QiJxmoy9GXmUvJkwHwYDVR0jBBgwFoAUe+1G6OC7dLnyQiJxmoy9GXmUvJkwDwYD
VR0TAQH/BAUwAwEB/zAaBgNVHREEEzARhwR/AAABgglsb2NhbGhvc3QwCgYIKoZI
zj0EAwIDSQAwRgIhAMKihJkjP6ipWKFt3aKBFOGZPE/8hjzQ5hcjcyUqSnGxAiEA
xGnH54BmZC7ClLbaQSth8EcZKe0U66VHe5Tr89oKIWI=
-----END CERTIFICATE-----
"""
KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgS3i98tzUPiXCoYQD
qhs0/w8p3eX1MTxIprBH6+TZdxyhRANCAATfkWu2VdHENO+vcl1v4urRaHr+9PKH
9oQ6zr1arU7Pdb+ToL03RwdZkOAsICYoVz0dQqk37qMNWqclNTnkyQwr
-----END PRIVATE KEY-----
"""


@pytest.fixture()
def pem(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text(CERT)
    key.write_text(KEY)
    return cert, key


def test_the_api_over_https(tool_core, tmp_path, pem):
    cert, key = pem
    d = Daemon(tool_core, tmp_path, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", d.port, context=ctx, timeout=30)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
        conn.close()
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{d.port}/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=ctx))
        out = client.chat.completions.create(model="tiny", temperature=0, max_tokens=8,
                                             messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert out.choices[0].message.content == "It is sunny in Paris."
        streamed = client.chat.completions.create(model="tiny", temperature=0, max_tokens=8, stream=True,
                                                  messages=[{"role": "user", "content": "Sing: la"}])
        assert sum(1 for _ in streamed) > 1
        plain = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)  # plain HTTP is not spoken there
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            plain.request("GET", "/health")
            plain.getresponse().read()
        assert "listening on https://" in d.log()
        # an absolute URL in an answer names the scheme the server speaks: the SDK fetches results_url as given
        anth = anthropic.Anthropic(base_url=f"https://127.0.0.1:{d.port}", api_key="unused", max_retries=0,
                                   http_client=anthropic.DefaultHttpxClient(verify=ctx))
        batch = anth.messages.batches.create(requests=[{"custom_id": "a", "params": {
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}])
        while (batch := anth.messages.batches.retrieve(batch.id)).processing_status != "ended":
            time.sleep(0.05)
        assert batch.results_url.startswith("https://")
        assert [r.custom_id for r in anth.messages.batches.results(batch.id)] == ["a"]
    finally:
        d.kill()


def test_certificate_and_key_go_together(pem, tmp_path):
    cert, key = pem
    with pytest.raises(ConfigError, match="ssl_keyfile"):
        ServerConfig(ssl_certfile=str(cert))
    with pytest.raises(ConfigError, match="ssl_certfile"):
        ServerConfig(ssl_certfile=str(tmp_path / "missing.pem"), ssl_keyfile=str(key))
    with pytest.raises(ConfigError, match="cannot load"):
        ServerConfig(ssl_certfile=str(key), ssl_keyfile=str(cert)).ssl_context()
    assert ServerConfig(ssl_certfile=str(cert), ssl_keyfile=str(key)).ssl_context() is not None
