"""A loopback TCP proxy that models a slower network link for the S3 benchmark (row 7d).

    python benchmarks/link_proxy.py LISTEN_PORT TARGET_HOST TARGET_PORT RATE_BYTES_PER_S [up|down]

Prints the port it listens on (useful with ``LISTEN_PORT`` 0), then forwards every connection to
the target. Bytes from clients to the target (uploads; ``down``: the replies, i.e. downloads, as
``benchmarks/replica_bench.py`` uses it) share one token bucket of ``RATE`` bytes/s
with a 1 MiB burst, over all connections together, as one network link would; the other direction
is not limited. It runs in its own process, so it takes no GIL time from the client under test, and it
copies 64 KiB at a time (a few percent of one core at 100 MB/s).

Why: on loopback the S3 server shares the 2 cores with the client, so section 7a measures CPU, not
the network. Where the link is the bottleneck, the time until durable is set by the bytes sent:
this is the regime in which ckptstore's compressed, streamed upload is meant to win.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

CHUNK = 64 << 10
BURST = 1 << 20


async def _serve(listen_port: int, host: str, port: int, rate: float, down: bool = False) -> None:
    clock = {"t": time.monotonic()}  # when the link is free again

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limited: bool) -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                if limited:
                    now = time.monotonic()
                    clock["t"] = max(clock["t"], now - BURST / rate) + len(data) / rate
                    if clock["t"] > now:
                        await asyncio.sleep(clock["t"] - now)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(host, port)
        except OSError:
            cw.close()
            return
        await asyncio.gather(pipe(cr, sw, not down), pipe(sr, cw, down))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


class LinkProxy:
    """This script in a subprocess, forwarding to ``endpoint`` (``http://host:port``) with one
    direction limited to ``rate`` bytes/s (``"up"``: client to server, ``"down"``: the replies);
    ``endpoint`` is the proxy's own. Used by ``s3_bench.py`` (up) and ``replica_bench.py`` (down)."""

    def __init__(self, endpoint: str, rate: float, direction: str = "up") -> None:
        host, port = endpoint.split("://", 1)[1].rstrip("/").rsplit(":", 1)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "0", host, port, str(rate), direction],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            raise RuntimeError(f"link_proxy.py did not start (said {line!r})")
        self.endpoint = f"http://127.0.0.1:{line}"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except Exception:  # noqa: BLE001 - a stuck proxy is killed
            self.proc.kill()


def main() -> int:
    listen_port, host, port, rate = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    down = len(sys.argv) > 5 and sys.argv[5] == "down"
    try:
        asyncio.run(_serve(listen_port, host, port, rate, down))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
