"""The "tcp" transport: bucket bytes streamed from the trainer to vLLM's workers over a socket.

For a trainer and a server on different hosts. The trainer stages buckets exactly as for "shm" (files in
its own `staging_dir`) and serves them with a `BucketServer` listening on `host:port`; each
`/update_weights` call tells the worker where to connect (`{"host", "port", "token", "timeout_s"}`),
and the worker asks for its buckets one by one over one connection.

Framing (both directions; JSON headers, raw bytes, never pickle)::

    b"RLWS" | u64 big-endian header length | JSON header | payload (header["nbytes"] bytes, may be 0)

- request (worker -> trainer): `{"token": str, "bucket": int}`, no payload;
- reply (trainer -> worker): `{"bucket": int, "nbytes": int}` + the bucket file's bytes, or
  `{"error": str}` (an unknown token or bucket).

`token` is a random per-sync secret (the port is reachable by anyone on the network; the endpoints
themselves should only be reachable on a private one). Every socket has a timeout: a peer that dies or
stalls gives a clear `ConnectionError`/`TimeoutError` naming the bucket and the byte count, never a hang.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading

MAGIC = b"RLWS"
_LEN = struct.Struct(">Q")
MAX_HEADER = 1 << 20
SOCKET_BUFFER = 4 << 20  # bytes; the kernel caps it at net.core.{r,w}mem_max (3-5x faster than default)
RECV_CHUNK = 1 << 24


def _tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


class StreamError(ConnectionError):
    """The peer closed the connection early, sent a malformed frame, or answered with an error."""


def send_frame(sock: socket.socket, header: dict, payload: bytes | memoryview = b"") -> None:
    data = json.dumps(header).encode()
    sock.sendall(MAGIC + _LEN.pack(len(data)) + data)
    if len(payload):
        sock.sendall(payload)


def recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fills `view` from `sock`; raises StreamError on EOF (naming `what` and the bytes received)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, RECV_CHUNK))
        if k == 0:
            raise StreamError(
                f"weight sync (tcp): connection closed by the peer after {got} of {n} bytes of {what}"
            )
        got += k


def recv_header(sock: socket.socket, what: str) -> dict:
    head = bytearray(len(MAGIC) + _LEN.size)
    recv_exact(sock, memoryview(head), f"the frame header of {what}")
    if bytes(head[:4]) != MAGIC:
        raise StreamError(f"weight sync (tcp): bad frame magic {bytes(head[:4])!r} in {what}")
    (size,) = _LEN.unpack(head[4:])
    if size > MAX_HEADER:
        raise StreamError(f"weight sync (tcp): frame header of {what} too large ({size} bytes)")
    data = bytearray(size)
    recv_exact(sock, memoryview(data), f"the frame header of {what}")
    try:
        header = json.loads(data)
    except ValueError as e:
        raise StreamError(f"weight sync (tcp): malformed frame header in {what}: {e}") from e
    if not isinstance(header, dict):
        raise StreamError(f"weight sync (tcp): frame header of {what} is not a JSON object")
    return header


class BucketServer:
    """Serves staged bucket files (by index) to workers that present `token`; one thread per connection.

    `fault` (tests only): `("close", n)` closes each connection after `n` payload bytes, as a trainer
    that dies mid-stream would; `("stall", n)` stops sending after `n` bytes but keeps the socket open.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0):
        self.token = secrets.token_hex(16)
        self.timeout_s = timeout_s
        self.fault: tuple[str, int] | None = None
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()
        self._sent = threading.Condition()
        self._sent_count, self._failed = 0, False
        self._sock = socket.create_server((host, port))
        _tune(self._sock)  # inherited by accepted connections
        self._sock.settimeout(0.2)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True, name="rljax-ws-tcp")
        self._accept.start()

    def add(self, index: int, path: str) -> None:
        with self._lock:
            self._paths[int(index)] = str(path)

    def remove(self, index: int) -> None:
        with self._lock:
            self._paths.pop(int(index), None)

    def wait_sent(self, count: int, timeout_s: float) -> bool:
        """Blocks until `count` buckets were sent in full (all connections together), a connection
        failed, or `timeout_s` passed; True only in the first case."""
        with self._sent:
            self._sent.wait_for(lambda: self._sent_count >= count or self._failed, timeout_s)
            return self._sent_count >= count

    def _note(self, sent: bool) -> None:
        with self._sent:
            if sent:
                self._sent_count += 1
            else:
                self._failed = True
            self._sent.notify_all()

    def address(self, timeout_s: float) -> dict:
        """The `tcp` part of an update_info: where and how the worker fetches its buckets."""
        return {"host": self.host, "port": self.port, "token": self.token, "timeout_s": float(timeout_s)}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout_s)
            _tune(conn)
            try:
                while not self._stop.is_set():
                    try:
                        req = recv_header(conn, "a bucket request")
                    except StreamError:
                        return  # the worker closed the connection: done
                    if req.get("token") != self.token:
                        send_frame(conn, {"error": "bad token"})
                        return self._note(False)
                    with self._lock:
                        path = self._paths.get(int(req.get("bucket", -1)))
                    if path is None:
                        send_frame(conn, {"error": f"unknown bucket {req.get('bucket')!r}"})
                        return self._note(False)
                    if not self._send_file(conn, int(req["bucket"]), path):
                        return self._note(False)
                    self._note(True)
            except OSError:
                return self._note(False)  # the worker died or timed out; it reports its own error

    def _send_file(self, conn: socket.socket, index: int, path: str) -> bool:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            send_frame(conn, {"bucket": index, "nbytes": size})
            if self.fault is not None:
                kind, n = self.fault
                conn.sendall(f.read(min(size, n)))
                if kind == "stall":
                    self._stop.wait()
                conn.shutdown(socket.SHUT_RDWR)
                return False
            if size:
                conn.sendfile(f, 0, size)
        return True

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        self._accept.join(timeout=5)
        for t in self._threads:
            t.join(timeout=1)

    def __enter__(self) -> BucketServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BucketClient:
    """The worker's side: one connection, `fetch(index, into)` per bucket."""

    def __init__(self, address: dict):
        try:
            self.host, self.port = str(address["host"]), int(address["port"])
            self.token, self.timeout_s = str(address["token"]), float(address.get("timeout_s", 30.0))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"weight sync (tcp): bad tcp address {address!r}: {e}") from e
        try:
            addrs = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, kind, proto, _, addr = addrs[0]
            self._sock = socket.socket(family, kind, proto)
            _tune(self._sock)  # before connect: the receive window is negotiated then
            self._sock.settimeout(self.timeout_s)
            try:
                self._sock.connect(addr)
            except OSError:
                self._sock.close()
                raise
        except OSError as e:
            raise StreamError(
                f"weight sync (tcp): cannot connect to the trainer at {self.host}:{self.port}: {e}"
            ) from e
        self._sock.settimeout(self.timeout_s)

    def fetch(self, index: int, allocate) -> tuple[object, int]:
        """Requests bucket `index`; `allocate(nbytes)` returns a writable buffer (kept by the caller).
        Returns `(buffer, nbytes)`."""
        what = f"bucket {index} from {self.host}:{self.port}"
        try:
            send_frame(self._sock, {"token": self.token, "bucket": int(index)})
            header = recv_header(self._sock, what)
            if "error" in header:
                raise StreamError(f"weight sync (tcp): the trainer refused {what}: {header['error']}")
            nbytes = int(header["nbytes"])
            buf = allocate(nbytes)
            recv_exact(self._sock, memoryview(buf).cast("B")[:nbytes], what)
            return buf, nbytes
        except TimeoutError as e:
            raise TimeoutError(
                f"weight sync (tcp): no data from the trainer for {self.timeout_s:.1f} s"
                f" while receiving {what}"
            ) from e

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
