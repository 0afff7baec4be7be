"""An S3 endpoint on 127.0.0.1 for tests: moto's server mode (as s3fs's own test suite
uses it) behind a small HTTP proxy that counts what clients fetch and can answer the next
k data reads with 503, as S3 does when it sheds load. Nothing reaches outside the machine.

The proxy also misbehaves on purpose (``/__proxy__/misbehave``), as a broken cache, CDN or
S3-compatible server does: it ignores ``Range`` (200 with the whole object), answers
another range than asked (206 with a ``Content-Range`` that says so), sends a short or a
long body under the right ``Content-Range``, or redirects; and it can replace an object in
the store after a number of reads of it (``/__proxy__/swap``), through the store's own API,
so that a load sees the object change between its header read and its data read.
And it can make every ranged GET slow to answer (``/__proxy__/delay``), as a distant store
is: its answer held back that long before its first byte.

The proxy measures bytes independently of the code under test: the body bytes of every
GET it relays, per object.
"""

from __future__ import annotations

import atexit
import http.client
import http.server
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

moto_server = pytest.importorskip("moto.server", reason="moto[server] not installed (pip install -r requirements-dev.txt)")
pytest.importorskip("s3fs", reason="s3fs not installed (pip install metaseq-oneload[remote])")

_SLOW = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
         b"<Message>Service is unable to handle the request.</Message></Error>")
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class _Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.zero()

    def zero(self):
        """(holding the lock, or before any thread runs)"""
        self.gets = 0
        self.ranged_gets = 0
        self.heads = 0
        self.lists = 0
        self.body_bytes = 0
        self.bytes_by_key: dict = {}
        self.fail_next = 0
        self.failed = 0
        self.mode = ""  # misbehaviour for ranged GETs: see S3Endpoint.misbehave
        self.mode_key = ""  # only for this object (all where empty)
        self.mode_after = 0  # ranged GETs passed through untouched first
        self.mode_left = 0  # ranged GETs to misbehave on
        self.misbehaved = 0
        self.whole_as_200 = 0  # whole-object ranges answered 200 (mode whole_as_200)
        self.swap = None  # (key, ranged GETs before the swap, local file with the new bytes)
        self.swapped = 0
        self.delay_s = 0.0  # each ranged GET's answer held back this long before its first byte


class _Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: tuple = ("127.0.0.1", 0)
    counters: _Counters = None

    def log_message(self, *args):  # quiet
        pass

    def _relay(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        c = self.counters
        parsed = urllib.parse.urlsplit(self.path)
        key = urllib.parse.unquote(parsed.path)
        if key.startswith("/__proxy__/"):
            return _control(self, parsed)
        ranged = self.command == "GET" and "Range" in self.headers
        with c.lock:
            if self.command == "GET":
                c.gets += 1
                c.ranged_gets += ranged
                c.lists += "list-type" in parsed.query or (key.count("/") <= 1 and not ranged)
            elif self.command == "HEAD":
                c.heads += 1
            fail = ranged and c.fail_next > 0
            if fail:
                c.fail_next -= 1
                c.failed += 1
            mode = ""
            if ranged and not fail and c.mode and c.mode_left > 0 and c.mode_key in ("", key):
                if c.mode_after > 0:
                    c.mode_after -= 1
                else:
                    mode = c.mode
                    c.mode_left -= 1
                    c.misbehaved += 1
            delay = c.delay_s if ranged else 0.0
            swap = None
            if ranged and c.swap is not None and c.swap[0] == key:
                if c.swap[1] > 0:
                    c.swap = (key, c.swap[1] - 1, c.swap[2])
                else:
                    swap, c.swap = c.swap, None
                    c.swapped += 1
        if fail:
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(_SLOW)))
            self.end_headers()
            self.wfile.write(_SLOW)
            return
        if swap is not None:  # the object changes in the store before this read reaches it
            _put(self.upstream, key, Path(swap[2]).read_bytes())
        if mode == "redirect":
            self.send_response(307)
            self.send_header("Location", f"http://{self.upstream[0]}:{self.upstream[1]}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if mode == "ignore_range":
            headers = {k: v for k, v in headers.items() if k.lower() != "range"}
        elif mode == "other_range":  # 16 bytes off: an honest Content-Range, the wrong bytes
            a, b = (int(x) for x in headers["Range"].split("=", 1)[1].split("-"))
            d = -16 if a >= 16 else 16
            headers["Range"] = f"bytes={a + d}-{b + d}"
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        status, drop = resp.status, set()
        if mode == "short_body":
            data = data[:-7]
        elif mode == "long_body":
            data = data + b"\0" * 7
        elif mode == "whole_as_200" and status == 206:
            # as some S3-compatible servers and CDNs do: a range that covers the whole object
            # is answered 200, without Content-Range (the body is the whole object)
            m = re.match(r"bytes 0-(\d+)/(\d+)$", resp.getheader("Content-Range") or "")
            if m and int(m.group(1)) + 1 == int(m.group(2)):
                status, drop = 200, {"content-range"}
                with c.lock:
                    c.whole_as_200 += 1
        if delay > 0:
            time.sleep(delay)
        if self.command == "GET":
            with c.lock:
                c.body_bytes += len(data)
                c.bytes_by_key[key] = c.bytes_by_key.get(key, 0) + len(data)
        self.send_response(status)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and k.lower() != "content-length" and k.lower() not in drop:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data) if self.command != "HEAD" else resp.getheader("Content-Length") or 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _put(upstream: tuple, key: str, data: bytes) -> None:
    """Replace /bucket/key in the store, through its own API."""
    import boto3

    bucket, name = key.lstrip("/").split("/", 1)
    boto3.client("s3", endpoint_url=f"http://{upstream[0]}:{upstream[1]}", region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").put_object(
                     Bucket=bucket, Key=name, Body=data)


def _control(handler: _Proxy, parsed) -> None:
    """/__proxy__/counters (GET: JSON), /__proxy__/reset, /__proxy__/fail?n=K,
    /__proxy__/misbehave?mode=M[&key=/bucket/key][&after=N][&n=K] (M: ignore_range,
    other_range, short_body, long_body, redirect, whole_as_200; an empty M stops),
    /__proxy__/swap?key=/bucket/key&after=N&src=LOCAL_FILE, /__proxy__/delay?s=SECONDS."""
    c = handler.counters
    q = {k: v[0] for k, v in urllib.parse.parse_qs(parsed.query).items()}
    with c.lock:
        if parsed.path.endswith("/reset"):
            c.zero()
        elif parsed.path.endswith("/fail"):
            c.fail_next = int(q["n"])
        elif parsed.path.endswith("/misbehave"):
            c.mode, c.mode_key = q.get("mode", ""), q.get("key", "")
            c.mode_after, c.mode_left = int(q.get("after", 0)), int(q.get("n", 10 ** 9))
        elif parsed.path.endswith("/swap"):
            c.swap = (q["key"], int(q.get("after", 0)), q["src"])
        elif parsed.path.endswith("/delay"):
            c.delay_s = float(q.get("s", 0))
        body = json.dumps({k: v for k, v in vars(c).items() if k != "lock"}).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def serve() -> None:
    """(a process of its own) moto and the proxy; prints the two ports, serves until killed."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    moto = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    handler = type("Proxy", (_Proxy,), {"upstream": (host, port), "counters": _Counters()})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    proxy.daemon_threads = True
    print(json.dumps({"moto": port, "proxy": proxy.server_address[1]}), flush=True)
    proxy.serve_forever()


class Counters:
    """What the proxy has counted since the last reset (fetched from it)."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def proxy_control(url: str, what: str) -> dict:
    """Ask the proxy at ``url`` (any process may): ``counters``, ``reset``, ``fail?n=K``."""
    with urllib.request.urlopen(f"{url}/__proxy__/{what}", timeout=30) as r:
        return json.loads(r.read())


def running_endpoint():
    """The body of a test module's endpoint fixture (``yield from running_endpoint()``): an
    :class:`S3Endpoint`, stopped after the module; the module skips where moto's server or
    s3fs is not installed."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    ep = S3Endpoint()
    try:
        yield ep
    finally:
        ep.stop()


class S3Endpoint:
    """moto on 127.0.0.1 plus the counting, failing proxy in front of it, in a process of
    their own (so that what the test process allocates and fetches is the package's alone)."""

    def __init__(self):
        # this process's import path: the server finds moto wherever this process did
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.s3_server import serve; serve()"],
                                     cwd=str(Path(__file__).resolve().parents[1]), stdout=subprocess.PIPE,
                                     text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the S3 test server did not start (exit code {self.proc.wait()})")
        atexit.register(self.stop)  # never outlive the tests, even where a test forgot to stop it
        ports = json.loads(line)
        self.direct_url = f"http://127.0.0.1:{ports['moto']}"
        self.url = f"http://127.0.0.1:{ports['proxy']}"

    def _ctl(self, what: str) -> dict:
        return proxy_control(self.url, what)

    @property
    def counters(self) -> Counters:
        return Counters(self._ctl("counters"))

    def reset(self) -> None:
        self._ctl("reset")

    def fail_next(self, n: int) -> None:
        """Answer the next ``n`` ranged GETs with 503 ServiceUnavailable."""
        self._ctl(f"fail?n={n}")

    def misbehave(self, mode: str, *, key: str = "", after: int = 0, n: int = 10 ** 9) -> None:
        """Answer ranged GETs (of ``key``, after ``after`` good ones, ``n`` of them) wrongly:
        ``ignore_range`` (200, the whole object), ``other_range`` (206 for a range 16 bytes
        off, saying so), ``short_body``/``long_body`` (7 bytes fewer/more under the right
        Content-Range), ``redirect`` (307 to the store itself), ``whole_as_200`` (200 without
        Content-Range for a range that covers the whole object, as some S3-compatible servers
        and CDNs answer; other ranges pass); ``""`` behaves again."""
        q = urllib.parse.urlencode({"mode": mode, "key": key, "after": after, "n": n})
        self._ctl(f"misbehave?{q}")

    def swap_after(self, key: str, after: int, src: Path) -> None:
        """Replace ``/bucket/key`` in the store with the bytes of ``src`` just before the
        proxy relays the ranged GET of it that follows ``after`` more of them."""
        q = urllib.parse.urlencode({"key": key, "after": after, "src": str(src)})
        self._ctl(f"swap?{q}")

    def delay(self, seconds: float) -> None:
        """Hold each ranged GET's answer back ``seconds`` before its first byte (0: at once),
        as a store far away or busy answers; ``reset`` ends it too."""
        self._ctl(f"delay?s={float(seconds)}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.direct_url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def upload(self, local: Path, bucket: str, prefix: str) -> str:
        """Put a file or every file of a folder under s3://bucket/prefix; returns that URL."""
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        local = Path(local)
        files = [local] if local.is_file() else sorted(p for p in local.iterdir() if p.is_file())
        for p in files:
            key = f"{prefix}/{p.name}" if local.is_dir() else prefix
            c.upload_file(str(p), bucket, key)
        return f"s3://{bucket}/{prefix}"

    def env(self, *, botocore_retries: bool = False) -> dict:
        """What a process needs to reach this endpoint through the package: credentials, and
        storage options naming the proxy (botocore's own retries off by default, so that the
        package's retries are the ones tested)."""
        s3 = {"endpoint_url": self.url}
        if not botocore_retries:
            s3["config_kwargs"] = {"retries": {"max_attempts": 0, "mode": "standard"}}
        return {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "METASEQ_ONELOAD_STORAGE_OPTIONS": json.dumps({"s3": s3}),
            "METASEQ_ONELOAD_REMOTE_BACKOFF": "0.01",
        }


def apply_env(env: dict, monkeypatch: Optional[pytest.MonkeyPatch] = None) -> None:
    for k, v in env.items():
        if monkeypatch is not None:
            monkeypatch.setenv(k, v)
        else:
            os.environ[k] = v
