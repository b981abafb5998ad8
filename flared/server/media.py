"""Images named by URL, as vLLM and OpenAI take them: ``http(s)://`` fetched, ``file://`` read from an allowed
directory. Runs on a frontend worker (a blocking read, bounded in bytes and time).

Rules:
- ``http``/``https``: fetched with a timeout (``media_fetch_timeout_s``), at most ``max_bytes`` read, redirects
  followed (at most 3) only to hosts the allow list takes. ``allowed_media_domains`` (vLLM's
  ``--allowed-media-domains``) limits the hosts, a redirect's included; empty: any host. ``media_fetch = false``
  refuses every remote URL.
- ``file://``: only under ``allowed_local_media_path`` (vLLM's ``--allowed-local-media-path``), after resolving
  links and ``..``; unset: refused.
- Every failure is a ``FrontendError`` that says what went wrong (the route answers 400 naming the part).
"""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from flared.errors import ErrorKind, FrontendError

MAX_REDIRECTS = 3
USER_AGENT = "flared (image fetch)"


def is_media_url(source) -> bool:
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://", "file://"))


@dataclasses.dataclass(frozen=True)
class MediaFetcher:
    fetch_remote: bool = True
    allowed_domains: tuple[str, ...] = ()  # lower-case host names; empty: any
    local_root: str | None = None
    timeout_s: float = 5.0

    def fetch(self, url: str, *, max_bytes: int, what: str = "image") -> bytes:
        """The bytes at ``url`` (``what``: "image" or "audio", as the errors name it)."""
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "file":
            return self._read_file(url, max_bytes, what)
        if scheme not in ("http", "https"):
            raise FrontendError(f"{what} URLs may be http, https or file, not {scheme!r}", ErrorKind.VALIDATION)
        if not self.fetch_remote:
            raise FrontendError(f"this server does not fetch {what} URLs; send the {what} as a base64 data URL",
                                ErrorKind.UNSUPPORTED)
        self._check_host(url, what)
        opener = urllib.request.build_opener(_Redirects(self, what))
        request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept": f"{what}/*"})
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                data = response.read(max_bytes + 1)
        except urllib.error.HTTPError as exc:
            raise FrontendError(f"fetching the {what} failed: HTTP {exc.code} from {_host(url)}",
                                ErrorKind.VALIDATION) from None
        except FrontendError:
            raise
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise FrontendError(f"fetching the {what} from {_host(url)} failed: {reason}",
                                ErrorKind.VALIDATION) from None
        if len(data) > max_bytes:
            raise FrontendError(f"the {what} at {_host(url)} is larger than {max_bytes} bytes", ErrorKind.VALIDATION)
        return data

    def _check_host(self, url: str, what: str = "image") -> None:
        host = _host(url)
        if not host:
            raise FrontendError(f"the {what} URL has no host", ErrorKind.VALIDATION)
        if self.allowed_domains and host not in self.allowed_domains:
            raise FrontendError(f"{what} URLs are fetched only from {', '.join(self.allowed_domains)}, not {host}",
                                ErrorKind.VALIDATION)

    def _read_file(self, url: str, max_bytes: int, what: str = "image") -> bytes:
        if self.local_root is None:
            raise FrontendError(f"file:// {what} URLs are not read (the server sets no allowed_local_media_path)",
                                ErrorKind.UNSUPPORTED)
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise FrontendError(f"file:// {what} URLs must name a local path", ErrorKind.VALIDATION)
        root = Path(self.local_root).resolve()
        path = Path(urllib.parse.unquote(parts.path)).resolve()
        if path != root and root not in path.parents:
            raise FrontendError(f"{what} files are read only under {root}", ErrorKind.VALIDATION)
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as exc:
            raise FrontendError(f"cannot read the {what} file {path}: {exc.strerror}", ErrorKind.VALIDATION) from None
        if len(data) > max_bytes:
            raise FrontendError(f"the {what} file {path} is larger than {max_bytes} bytes", ErrorKind.VALIDATION)
        return data


def _host(url: str) -> str:
    return (urllib.parse.urlsplit(url).hostname or "").lower()


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed at most MAX_REDIRECTS times, each to a host the allow list takes."""
    max_redirections = MAX_REDIRECTS

    def __init__(self, fetcher: MediaFetcher, what: str = "image"):
        super().__init__()
        self.fetcher = fetcher
        self.what = what

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise FrontendError(f"the {self.what} URL redirects out of http(s)", ErrorKind.VALIDATION)
        self.fetcher._check_host(newurl, self.what)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
