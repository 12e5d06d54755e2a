"""A trainer-side bucket stream that dies or stalls mid-bucket, wired in from the tests.

`install(monkeypatch, kind, n)` replaces `stream.BucketServer._send_file` for the test: after the bucket's
header and `n` payload bytes, `"close"` shuts the connection, as a trainer that dies mid-stream would, and
`"stall"` stops sending but keeps the socket open until the server closes. Production code has no such switch.
"""

import os
import socket

from rljax.weight_sync import stream


def install(monkeypatch, kind: str, n: int) -> None:
    assert kind in ("close", "stall"), kind

    def send_part(self, conn: socket.socket, index: int, path: str) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            stream.send_frame(conn, {"bucket": index, "nbytes": size})
            conn.sendall(f.read(min(size, n)))
            if kind == "stall":
                self._stop.wait()
            conn.shutdown(socket.SHUT_RDWR)
        return None  # cut short: not counted as sent

    monkeypatch.setattr(stream.BucketServer, "_send_file", send_part)
