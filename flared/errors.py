"""Error taxonomy.

Every error flared raises on purpose is a ``FlareError``. Its ``kind`` (an
enum member, never a free string) says what went wrong in a way the HTTP layer
maps to a status code and a client can branch on; the message says it for a
person. Subclasses tell which stage of the request path failed:

- ``AdmissionError``: a request could not be accepted (validation, capacity,
  context length, unsupported feature).
- ``ExecutionError``: the model thread or the device failed after admission.
- ``FrontendError``: tokenizer or chat-template assets, rendering, decoding.
- ``CoreError``: a prepared core (or an export source) is missing, corrupt or
  unsupported.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    # value = (wire name, HTTP status)
    VALIDATION = ("invalid_request_error", 400)
    UNSUPPORTED = ("unsupported", 400)
    CONTEXT_LENGTH = ("context_length_exceeded", 400)
    TEMPLATE = ("template_error", 400)
    UNAUTHORIZED = ("authentication_error", 401)
    NOT_FOUND = ("not_found_error", 404)
    HTTP_CAPACITY = ("rate_limit_error", 429)
    MODEL_CAPACITY = ("overloaded_error", 503)
    UNAVAILABLE = ("unavailable", 503)
    EXECUTION = ("execution_error", 500)
    DEVICE = ("device_error", 500)
    POISONED = ("poisoned", 500)
    DRAIN = ("drain_failed", 500)
    TOKENIZER = ("tokenizer_error", 500)
    FINGERPRINT = ("fingerprint_mismatch", 500)
    CORE_FORMAT = ("core_format_error", 500)
    CORE_HASH = ("core_hash_mismatch", 500)
    CORE_MISSING = ("core_missing", 500)
    UNSUPPORTED_MODEL = ("unsupported_model", 500)
    SOURCE_FORMAT = ("source_format_error", 500)

    @property
    def wire_name(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]


class FlareError(Exception):
    """Base of every deliberate flared error."""

    default_kind = ErrorKind.EXECUTION

    def __init__(self, message: str, kind: ErrorKind | None = None, *, hint: str | None = None):
        self.kind = kind if kind is not None else self.default_kind
        self.hint = hint
        super().__init__(message if hint is None else f"{message} ({hint})")

    @property
    def http_status(self) -> int:
        return self.kind.http_status


class AdmissionError(FlareError):
    default_kind = ErrorKind.VALIDATION


class ExecutionError(FlareError):
    default_kind = ErrorKind.EXECUTION


class FrontendError(FlareError):
    default_kind = ErrorKind.TEMPLATE


class CoreError(FlareError):
    default_kind = ErrorKind.CORE_FORMAT
