"""The "tcp" transport: bucket bytes streamed from the trainer to vLLM's workers over a socket.

For a trainer and a server on different hosts. The trainer stages buckets exactly as for "shm" (files in
its own run directory) and serves them with a `BucketServer` listening on `host:port`; each
`/update_weights` call tells the worker where to connect (its `source`: `{"transport": "tcp", "id",
"host", "port", "token", "timeout_s"}`, see `transports`), and the worker asks for its buckets one by one.

Connection: the worker first sends a fixed 36-byte pre-auth header, `b"RLWA"` + the 32-byte per-sync token
(`token` is its hex form), compared with `hmac.compare_digest` before the server parses anything. Until
then a connection costs no thread: one selector thread reads every pending header, drops a connection
that sends a wrong one or is slower than `PREAUTH_TIMEOUT_S`, and drops the oldest pending connection
when more than `MAX_PENDING` wait (a legitimate worker sends its header at once). At most
`max_connections` authenticated connections are served at once. A stranger's connection never counts as
a failed transfer, so it cannot end the trainer's wait early or fail a sync.

Framing after that (both directions; JSON headers, raw bytes, never pickle)::

    b"RLWS" | u64 big-endian header length | JSON header | payload (header["nbytes"] bytes, may be 0)

- request (worker -> trainer): `{"bucket": int}`, no payload (header at most `MAX_REQUEST_HEADER` bytes);
- reply (trainer -> worker): `{"bucket": int, "nbytes": int}` + the bucket file's bytes, or
  `{"error": str}` (an unknown bucket). The worker checks `nbytes` against the size its tensor list
  implies before it allocates the buffer.

Every socket has a timeout: a peer that dies or stalls gives a clear `ConnectionError`/`TimeoutError`
naming the bucket and the byte count, never a hang.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import selectors
import socket
import struct
import threading
import time

MAGIC = b"RLWS"
_LEN = struct.Struct(">Q")
MAX_HEADER = 1 << 16
MAX_REQUEST_HEADER = 4096
PREAUTH_MAGIC = b"RLWA"
TOKEN_BYTES = 32
PREAUTH_LEN = len(PREAUTH_MAGIC) + TOKEN_BYTES
PREAUTH_TIMEOUT_S = 5.0  # a worker sends its pre-auth header right after connecting
MAX_PENDING = 64  # connections still to authenticate (beyond it the oldest is dropped)
MAX_CONNECTIONS = 64  # authenticated connections served at once (one per worker fetch)
ACCEPT_BATCH = 16  # connections accepted per selector round, between reads of the pending headers
LISTEN_BACKLOG = 1024  # connections the kernel queues before accept: a burst does not refuse a worker's
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


def recv_header(sock: socket.socket, what: str, max_size: int = MAX_HEADER) -> dict:
    head = bytearray(len(MAGIC) + _LEN.size)
    recv_exact(sock, memoryview(head), f"the frame header of {what}")
    if bytes(head[:4]) != MAGIC:
        raise StreamError(f"weight sync (tcp): bad frame magic {bytes(head[:4])!r} in {what}")
    (size,) = _LEN.unpack(head[4:])
    if size > max_size:
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
    """Serves staged bucket files (by index) to workers that present `token` (see the module docstring).

    `refused` counts connections dropped before authenticating.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 30.0,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.token = secrets.token_hex(TOKEN_BYTES)
        self.id = secrets.token_hex(8)  # names this sync's receive directory on each node (`fanout`)
        self.bytes_sent = 0  # payload bytes sent in full buckets (all connections)
        self._key = bytes.fromhex(self.token)
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self.refused = 0
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()
        self._sent = threading.Condition()
        self._sent_count, self._failed, self._active = 0, False, 0
        self._sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        _tune(self._sock)  # inherited by accepted connections
        self._sock.setblocking(False)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}  # oldest first
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
        """Blocks until `count` buckets were sent in full (all connections together), an authenticated
        connection failed, or `timeout_s` passed; True only in the first case."""
        with self._sent:
            self._sent.wait_for(lambda: self._sent_count >= count or self._failed, timeout_s)
            return self._sent_count >= count

    def _note(self, sent: bool, nbytes: int = 0) -> None:
        with self._sent:
            if sent:
                self._sent_count += 1
                self.bytes_sent += nbytes
            else:
                self._failed = True
            self._sent.notify_all()

    def address(self, timeout_s: float) -> dict:
        """The `source` of an update_info: where and how the worker fetches its buckets."""
        return {
            "transport": "tcp",
            "id": self.id,
            "host": self.host,
            "port": self.port,
            "token": self.token,
            "timeout_s": float(timeout_s),
        }

    def _serve(self) -> None:
        """The selector loop. Each round reads the pending connections' headers before it accepts more
        (at most `ACCEPT_BATCH`), so a burst of strangers cannot push a worker whose header is on its way
        out of the pending set; a fault on one connection drops that connection, never the loop."""
        try:
            while not self._stop.is_set():
                ready = self._sel.select(0.2)
                for key, _ in ready:
                    if key.fileobj is not self._sock and key.fileobj in self._pending:
                        self._guarded(key.fileobj)
                if any(key.fileobj is self._sock for key, _ in ready):
                    self._accept_ready()
                now = time.monotonic()
                for conn in [c for c, (deadline, _) in self._pending.items() if deadline < now]:
                    self._drop(conn)
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._sel.close()

    def _guarded(self, conn: socket.socket) -> None:
        try:
            self._preauth_ready(conn)
        except Exception:  # noqa: BLE001 - any fault of one stranger's connection ends that connection only
            if conn in self._pending:
                self._drop(conn)

    def _accept_ready(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed, or out of descriptors: the next round tries again
                return
            conn.setblocking(False)
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending)))
            self._pending[conn] = (time.monotonic() + min(PREAUTH_TIMEOUT_S, self.timeout_s), bytearray())
            self._sel.register(conn, selectors.EVENT_READ)
            self._guarded(conn)  # a worker's header is usually there already: no round trip through select

    def _drop(self, conn: socket.socket) -> None:
        """Closes a connection that did not authenticate (not a failed transfer)."""
        self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        self.refused += 1

    def _preauth_ready(self, conn: socket.socket) -> None:
        got = self._pending[conn][1]
        try:
            data = conn.recv(PREAUTH_LEN - len(got))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            return self._drop(conn)
        got += data
        if len(got) < PREAUTH_LEN:
            return
        if not (got[:4] == PREAUTH_MAGIC and hmac.compare_digest(bytes(got[4:]), self._key)):
            return self._drop(conn)
        with self._lock:
            if self._active >= self.max_connections:
                return self._drop(conn)
            self._active += 1
        self._pending.pop(conn)
        self._sel.unregister(conn)
        conn.setblocking(True)
        t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.timeout_s)
                self._serve_requests(conn)
        finally:
            with self._lock:
                self._active -= 1

    def _serve_requests(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                try:
                    req = recv_header(conn, "a bucket request", MAX_REQUEST_HEADER)
                except StreamError:
                    return  # the worker closed the connection: done
                index = req.get("bucket")
                with self._lock:
                    path = self._paths.get(index) if type(index) is int else None
                if path is None:
                    send_frame(conn, {"error": f"unknown bucket {str(index)[:40]}"})
                    return self._note(False)
                size = self._send_file(conn, index, path)
                if size is None:
                    return self._note(False)
                self._note(True, size)
        except OSError:
            return self._note(False)  # the worker died or timed out; it reports its own error

    def _send_file(self, conn: socket.socket, index: int, path: str) -> int | None:
        """Sends one bucket; returns its size (None: cut short, as the tests' `stream_faults` does)."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            send_frame(conn, {"bucket": index, "nbytes": size})
            if size:
                conn.sendfile(f, 0, size)
        return size

    def close(self) -> None:
        self._stop.set()
        self._accept.join(timeout=5)  # the selector thread closes pending connections and the selector
        try:
            self._sock.close()
        except OSError:
            pass
        for t in self._threads:
            t.join(timeout=1)

    def __enter__(self) -> BucketServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BucketClient:
    """The worker's side: one connection (pre-auth header first), `fetch(index, expected, allocate)` per
    bucket."""

    def __init__(self, address: dict):
        try:
            self.host, self.port = str(address["host"]), int(address["port"])
            key, self.timeout_s = bytes.fromhex(str(address["token"])), float(address.get("timeout_s", 30.0))
            if len(key) != TOKEN_BYTES:
                raise ValueError(f"the token must be {TOKEN_BYTES} bytes")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"weight sync (tcp): bad tcp address (host, port, token, timeout_s): {e}") from e
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
        self._key = key

    def fetch(self, index: int, expected: int, allocate) -> tuple[object, int]:
        """Requests bucket `index`, which must be `expected` bytes long (from its tensor list);
        `allocate(nbytes)` returns a writable buffer (kept by the caller), called only once the announced
        size matched. Returns `(buffer, nbytes)`."""
        what = f"bucket {index} from {self.host}:{self.port}"
        try:
            if self._key is not None:  # the pre-auth header, once per connection
                self._sock.sendall(PREAUTH_MAGIC + self._key)
                self._key = None
            send_frame(self._sock, {"bucket": int(index)})
            header = recv_header(self._sock, what)
            if "error" in header:
                raise StreamError(
                    f"weight sync (tcp): the trainer refused {what}: {str(header['error'])[:200]}"
                )
            nbytes = header.get("nbytes")
            if header.get("bucket") != index or type(nbytes) is not int or nbytes != expected:
                raise StreamError(
                    f"weight sync (tcp): the trainer announced {str(nbytes)[:40]} bytes for {what}, "
                    f"its tensor list needs {expected}"
                )
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
