"""A request- and byte-counting TCP proxy in front of an S3 server (SeaweedFS): what a job asks of
the remote tier, counted at the tier boundary.

``CountingProxy(upstream)`` forwards bytes unchanged both ways; ``endpoint`` is the URL to give the
ranks (``AWS_ENDPOINT_URL``). It records every HTTP request line the client sends (method, path) and,
for each response, its status and body bytes, paired with its request (HTTP/1.1 answers the requests of
one connection in order). :meth:`summary` counts them by kind, with the body bytes of GETs
(``get_bytes``, ``object_get_bytes``: the bytes a restore downloads). Requests are framed by their
headers and ``Content-Length``; a chunked request body makes the rest of that connection opaque
(recorded as ``("?", "")``); a chunked response stops the byte count of its connection (S3 object
GETs carry ``Content-Length``).
"""

from __future__ import annotations

import collections
import socket
import socketserver
import threading


class _ResponseMeter:
    """Walks one connection's response stream: pairs each response with the oldest request still
    unanswered and adds its body bytes to the proxy's record."""

    def __init__(self, proxy: "CountingProxy", pending: collections.deque) -> None:
        self.proxy = proxy
        self.pending = pending
        self.buf = b""
        self.left = 0
        self.rec: list | None = None
        self.opaque = False

    def feed(self, data: bytes) -> None:
        if self.opaque:
            return
        self.buf += data
        while True:
            if self.left:
                take = min(self.left, len(self.buf))
                if not take:
                    return
                with self.proxy._lock:
                    self.rec[3] += take
                self.left -= take
                self.buf = self.buf[take:]
                if self.left:
                    return
                continue
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head, self.buf = self.buf[:i].decode("latin-1"), self.buf[i + 4:]
            lines = head.split("\r\n")
            try:
                status = int(lines[0].split(" ", 2)[1])
            except (IndexError, ValueError):
                self.opaque = True
                return
            if 100 <= status < 200:
                continue  # interim (100 Continue): the final answer follows
            hdrs = {ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip() for ln in lines[1:] if ":" in ln}
            method, path = self.pending.popleft() if self.pending else ("?", "")
            self.rec = [method, path, status, 0]
            with self.proxy._lock:
                self.proxy.responses.append(self.rec)
            if method == "HEAD" or status in (204, 304):
                continue
            if "chunked" in hdrs.get("transfer-encoding", "").lower():
                self.opaque = True
                return
            self.left = int(hdrs.get("content-length", "0") or 0)


class CountingProxy:
    """See the module docstring. ``requests``: ``[(method, path)]``; ``responses``: ``[[method, path,
    status, body bytes]]``."""

    def __init__(self, upstream: str):
        host, port = upstream.split("://", 1)[-1].rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.requests: list[tuple[str, str]] = []
        self.responses: list[list] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                up = socket.create_connection(proxy.upstream, timeout=60)
                done = threading.Event()
                pending: collections.deque = collections.deque()
                meter = _ResponseMeter(proxy, pending)

                def back():
                    try:
                        while True:
                            b = up.recv(65536)
                            if not b:
                                break
                            meter.feed(b)
                            self.request.sendall(b)
                    except OSError:
                        pass
                    finally:
                        done.set()
                        try:
                            self.request.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass

                threading.Thread(target=back, daemon=True).start()
                try:
                    proxy._pump(self.request, up, pending)
                except OSError:
                    pass
                finally:
                    try:
                        up.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    done.wait(60)
                    up.close()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _pump(self, client: socket.socket, up: socket.socket, pending: collections.deque) -> None:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                b = client.recv(65536)
                if not b:
                    if buf:
                        up.sendall(buf)
                    return
                buf += b
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, path = (lines[0].split(" ") + ["", ""])[:2]
            hdrs = {ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip() for ln in lines[1:] if ":" in ln}
            with self._lock:
                self.requests.append((method, path))
            pending.append((method, path))  # before the request leaves: its answer cannot come first
            up.sendall(head + b"\r\n\r\n")
            if "chunked" in hdrs.get("transfer-encoding", "").lower():
                with self._lock:
                    self.requests.append(("?", ""))
                up.sendall(buf)
                while True:
                    b = client.recv(65536)
                    if not b:
                        return
                    up.sendall(b)
            n = int(hdrs.get("content-length", "0") or 0)
            while n > 0:
                if not buf:
                    buf = client.recv(min(n, 65536))
                    if not buf:
                        return
                chunk, buf = buf[:n], buf[n:]
                up.sendall(chunk)
                n -= len(chunk)

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.responses.clear()

    @staticmethod
    def _kind(method: str, path: str) -> str:
        p, _, q = path.partition("?")
        if method == "GET" and ("list-type" in q or "uploads" in q or p.rstrip("/").count("/") <= 1):
            return "lists"
        if method == "GET" and p.endswith(".ckd"):
            return "object_gets"
        if method == "GET":
            return "manifest_gets"
        if method == "HEAD":
            return "heads"
        if method in ("PUT", "POST", "DELETE"):
            return "writes"
        return "other"

    def summary(self) -> dict:
        """Counts: ``object_gets`` (GET of a stored object, ``*.ckd``: data read from S3),
        ``manifest_gets`` (other GETs of keys), ``lists``, ``heads``, ``writes``, ``other``; and body
        bytes of the answers: ``object_get_bytes`` (to GETs of stored objects), ``get_bytes`` (to every
        GET, listings included)."""
        out = dict(object_gets=0, manifest_gets=0, lists=0, heads=0, writes=0, other=0, object_get_bytes=0, get_bytes=0)
        with self._lock:
            reqs = list(self.requests)
            resps = [list(r) for r in self.responses]
        for method, path in reqs:
            out[self._kind(method, path)] += 1
        for method, path, _status, n in resps:
            if method == "GET":
                out["get_bytes"] += n
                if self._kind(method, path) == "object_gets":
                    out["object_get_bytes"] += n
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
