"""Local servers for the storage tests, on 127.0.0.1 only: a static HTTP server with Range support and an S3 API
(moto's server mode). Both count the requests they answer and the body bytes they send."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Traffic:
    """What a server answered: ``requests`` as ``(method, path, range header or None)``, ``sent`` body bytes."""

    requests: list = field(default_factory=list)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.sent = 0

    def add(self, method: str, path: str, rng: str | None, nbytes: int) -> None:
        with self.lock:
            self.requests.append((method, path, rng))
            self.sent += nbytes

    def gets(self) -> list:
        return [r for r in self.requests if r[0] == "GET"]


class HttpFiles:
    """Serves ``files`` (URL path -> bytes) at ``url``; GET honours ``Range: bytes=a-b`` (206), HEAD gives sizes."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.traffic = Traffic()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, body: bool) -> None:
                data = owner.files.get(self.path)
                rng = self.headers.get("Range")
                if data is None:
                    owner.traffic.add(self.command, self.path, rng, 0)  # before answering: the client may be quicker
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end = 0, len(data)
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
                if m:
                    start = int(m.group(1))
                    end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start))
                self.end_headers()
                chunk = data[start:end] if body else b""
                # counted before the body is sent: once the client has it, the count must already include it
                owner.traffic.add(self.command, self.path, rng, len(chunk))
                self.wfile.write(chunk)

            def do_GET(self):
                self._answer(True)

            def do_HEAD(self):
                self._answer(False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class MotoS3:
    """moto's S3 API served on 127.0.0.1 (werkzeug, in a thread), behind a middleware that counts traffic.

    ``options`` are the ``storage_options`` that point s3fs at it (fake credentials, no retries, no region lookup).
    """

    def __init__(self):
        import os

        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # never look for credentials off this machine
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self.traffic = Traffic()
        app = DomainDispatcherApplication(create_backend_app)
        traffic = self.traffic

        def counting(environ, start_response):
            body = app(environ, start_response)
            out = b"".join(body)
            if hasattr(body, "close"):
                body.close()
            traffic.add(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE"),
                        len(out) if environ["REQUEST_METHOD"] == "GET" else 0)
            return [out]

        self.server = make_server("127.0.0.1", 0, counting, threaded=True)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.options = {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                        "client_kwargs": {"region_name": "eu-west-1"}, "use_listings_cache": False,
                        "config_kwargs": {"retries": {"max_attempts": 1}}}

    def make_bucket(self, name: str) -> None:
        import s3fs

        try:
            s3fs.S3FileSystem(**self.options).mkdir(name)
        except FileExistsError:  # moto keeps its buckets per process, across servers
            pass

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# fixtures: import them into a test module (``from .servers import clean_memory, http, s3``)


@pytest.fixture(autouse=False)
def clean_memory():
    """fsspec's ``memory://`` filesystem, emptied before and after the test."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]
    yield fs
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]


@pytest.fixture(scope="module")
def http():
    """An ``HttpFiles`` server for the module; skipped without aiohttp (fsspec's http backend)."""
    pytest.importorskip("aiohttp")
    server = HttpFiles()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3():
    """A ``MotoS3`` server for the module, with a bucket ``packs``; skipped without moto or s3fs."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    server = MotoS3()
    server.make_bucket("packs")
    yield server
    server.stop()
