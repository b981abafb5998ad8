"""flared.server.batch_routes.parse_multipart: the multipart/form-data bodies that file uploads send."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flared.errors import AdmissionError
from flared.server.batch_routes import parse_multipart


def _body(boundary: bytes, parts: list[tuple[bytes, bytes]], *, preamble: bytes = b"", epilogue: bytes = b"") -> bytes:
    out = preamble
    for head, content in parts:
        out += b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + content + b"\r\n"
    return out + b"--" + boundary + b"--\r\n" + epilogue


def test_fields_files_and_tricky_contents():
    content = b"line1\r\n--B0und not at a part start\r\n\r\nline3\r\n-- B0und\r\n"
    body = _body(b"B0und", [
        (b'Content-Disposition: form-data; name="purpose"', b"batch"),
        (b'Content-Type: application/jsonl\r\ncontent-disposition: form-data; name="file"; filename="my \\"x\\".jsonl"',
         content),
        (b'Content-Disposition: form-data; name="empty"', b""),
    ], preamble=b"ignored preamble\r\n", epilogue=b"ignored epilogue")
    fields = parse_multipart('multipart/form-data; boundary="B0und"', body)
    assert fields["purpose"] == (None, b"batch")
    assert fields["file"] == ('my "x".jsonl', content)
    assert fields["empty"] == (None, b"")


def test_what_the_openai_sdk_sends():
    """httpx's encoding of files.create(file=(name, bytes), purpose=...): unquoted boundary, file part last."""
    body = (b'--7a1c\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--7a1c\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            b'Content-Type: application/octet-stream\r\n\r\n{"a": 1}\n\r\n--7a1c--\r\n')
    fields = parse_multipart("multipart/form-data; boundary=7a1c", body)
    assert fields == {"purpose": (None, b"batch"), "file": ("in.jsonl", b'{"a": 1}\n')}


@pytest.mark.parametrize("content_type, body, message", [
    ("application/json", b"{}", "multipart/form-data"),
    ("multipart/form-data", b"", "boundary"),
    ("multipart/form-data; boundary=x", b"no parts here", "no part"),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\nunterminated',
     "ends inside a part"),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="a"', "ends inside a part"),
])
def test_malformed_bodies_are_400s(content_type, body, message):
    with pytest.raises(AdmissionError, match=message):
        parse_multipart(content_type, body)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from([b"--x", b"\r\n", b"\r\n\r\n", b"--", b"--x--", b"Content-Disposition: form-data; ",
                                 b'name="a"', b"filename=", b'"', b"\\", b";", b" ", b"\t", b"data", b"\xff\x00"]),
                max_size=30))
def test_any_body_parses_or_is_a_400(pieces):
    try:
        fields = parse_multipart("multipart/form-data; boundary=x", b"".join(pieces))
    except AdmissionError:
        return
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, (_, v) in fields.items())

