"""A loopback HTTP proxy that drops chosen request headers: an S3 endpoint that "accepts and ignores"
``If-None-Match`` (pithings/mountx #19), made from a real server that enforces it.

``HeaderStrippingProxy(target, strip=("if-none-match",), strip_query=())`` forwards every request
(method, path, headers but the stripped ones, body — by ``Content-Length`` or chunked) to ``target``
and the answer back; ``strip_query`` names query parameters dropped too (GCS's
``ifGenerationMatch``); ``url`` is the endpoint to give the SDK, ``stripped`` counts what was dropped. Put it in front
of moto, which does not check signatures (SeaweedFS would refuse the request whose signed header is
gone).
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse

_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect"}


class HeaderStrippingProxy:
    def __init__(self, target_url: str, strip: tuple[str, ...] = ("if-none-match",), strip_query: tuple[str, ...] = ()):
        u = urllib.parse.urlsplit(target_url)
        self._target = (u.hostname, u.port)
        self.strip = {h.lower() for h in strip}
        self.strip_query = {q.lower() for q in strip_query}
        self.stripped = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _forward(self) -> None:
                body = self._body()
                headers = {}
                for k, v in self.headers.items():
                    lk = k.lower()
                    if lk in proxy.strip:
                        with proxy._lock:
                            proxy.stripped += 1
                        continue
                    if lk in _HOP or lk in ("transfer-encoding", "content-length"):
                        continue
                    headers[k] = v
                headers["Content-Length"] = str(len(body))
                path = self.path
                if proxy.strip_query and "?" in path:
                    base, _, query = path.partition("?")
                    kept = [kv for kv in query.split("&") if kv.split("=", 1)[0].lower() not in proxy.strip_query]
                    if len(kept) != len(query.split("&")):
                        with proxy._lock:
                            proxy.stripped += 1
                    path = base + ("?" + "&".join(kept) if kept else "")
                conn = http.client.HTTPConnection(*proxy._target, timeout=60)
                try:
                    conn.request(self.command, path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP and k.lower() not in ("transfer-encoding", "content-length"):
                            self.send_header(k, v)
                    # a HEAD answer keeps the object's length; anything else is sent with its body's
                    length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="header-proxy", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> "HeaderStrippingProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
