"""The "zmq" transport: bucket bytes pulled from the trainer over ZeroMQ with CURVE (pyzmq).

Same role as `stream` ("tcp"), on an established transport instead of our own framing:

- Sockets: the trainer binds one ROUTER (`ZmqBucketServer`), each worker connects a DEALER
  (`ZmqBucketClient`). Both are CURVE sockets: the trainer makes a server key pair and one client key
  pair per sync (`zmq.curve_keypair`), and each worker gets the server's public key and the client pair in
  its `update_info` (the control plane, itself behind the job's bearer token). A ZAP handler in the
  server's thread admits only that client public key; any other peer fails the CURVE handshake before a
  request reaches the server (`refused` counts them) and the worker gets a clear "refused" error at once.
  The stream is encrypted and authenticated by libsodium (zmq's CURVE), so nothing on the wire is ours to
  parse before authentication.
- Protocol (credit-based flow control, the zguide's file-transfer pattern): the worker asks for a bucket
  in chunks, `{"bucket": i, "offset": o, "size": s}` (JSON, one frame), keeping at most `WINDOW` requests
  in flight; each reply is two frames, `{"bucket", "offset", "nbytes": the bucket's size}` (JSON) and the
  chunk's bytes (sent zero-copy from a mapping of the bucket file, received into the caller's buffer with
  `recv_into`), or one frame `{"error": str}`. The worker checks `nbytes` against the size its tensor list
  implies before it allocates anything.
- Bounds: HWM on every socket (`HWM` messages; the ROUTER is `ROUTER_MANDATORY`, so a reply to a peer
  whose queue is full is dropped and counted in `dropped`, never buffered without bound); every receive
  has the sync's timeout (`timeout_s`): a trainer that dies or stalls gives a `TimeoutError` naming the
  bucket and the bytes received, never a hang.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import threading
import time

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from rljax.weight_sync.stream import StreamError

CHUNK_BYTES = 4 << 20  # one reply's payload
WINDOW = 4  # chunk requests in flight per worker (bytes in flight: WINDOW * CHUNK_BYTES)
HWM = 2 * WINDOW  # messages queued per peer on any socket
MAX_REQUEST = 4096  # bytes of any message from a peer (the CURVE handshake included)
IO_THREADS = 2  # the trainer's zmq I/O threads (CURVE encryption runs there, one connection each)
_ZAP = "inproc://zeromq.zap.01"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class ZmqBucketServer:
    """Serves staged bucket files (by index) to the worker key issued in `address()`; one thread.

    `bytes_sent` and `chunks_sent` count payload sent (all peers), `refused` CURVE handshakes refused,
    `dropped` replies dropped at a full peer queue. A send and its count are one step under a lock that the
    counters' readers take too: once a peer has a chunk, every read of the counts includes it.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.id = secrets.token_hex(8)
        self.server_public, server_secret = zmq.curve_keypair()
        self.client_public, self.client_secret = zmq.curve_keypair()
        self._bytes_sent = self._chunks_sent = self._dropped = self.refused = 0
        self._counts = threading.Lock()
        self._paths: dict[int, str] = {}
        self._maps: dict[int, mmap.mmap | None] = {}
        self._lock = threading.Lock()
        self._sent = threading.Condition()
        self._sent_count, self._failed = 0, False
        self._ctx = zmq.Context(io_threads=IO_THREADS)
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(_ZAP)  # before the ROUTER: every handshake asks it
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.curve_server = True
        self._sock.curve_secretkey = server_secret
        self._sock.zap_domain = b"rljax"
        self._sock.router_mandatory = True
        self._sock.sndhwm = self._sock.rcvhwm = HWM
        self._sock.maxmsgsize = MAX_REQUEST
        self._sock.sndtimeo = 0
        if ":" in host:
            self._sock.ipv6 = True
        self.host, self.port = host, port
        if port:
            self._sock.bind(f"tcp://{_bracket(host)}:{port}")
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{_bracket(host)}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="rljax-ws-zmq")
        self._thread.start()

    @property
    def bytes_sent(self) -> int:
        with self._counts:
            return self._bytes_sent

    @property
    def chunks_sent(self) -> int:
        with self._counts:
            return self._chunks_sent

    @property
    def dropped(self) -> int:
        with self._counts:
            return self._dropped

    def add(self, index: int, path: str) -> None:
        with self._lock:
            self._paths[int(index)] = str(path)

    def remove(self, index: int) -> None:
        with self._lock:
            self._paths.pop(int(index), None)
            self._maps.pop(int(index), None)  # chunks still queued keep the mapping alive until sent

    def address(self, timeout_s: float) -> dict:
        """The `source` of an update_info: where the worker pulls its buckets and the keys it uses."""
        return {
            "transport": "zmq",
            "id": self.id,
            "endpoint": f"tcp://{_bracket(self.host)}:{self.port}",
            "server_key": self.server_public.decode(),
            "public_key": self.client_public.decode(),
            "secret_key": self.client_secret.decode(),
            "timeout_s": float(timeout_s),
        }

    def wait_sent(self, count: int, timeout_s: float) -> bool:
        """Blocks until `count` buckets were sent in full (all peers together), a worker reported a failed
        fetch, or `timeout_s` passed; True only in the first case."""
        with self._sent:
            self._sent.wait_for(lambda: self._sent_count >= count or self._failed, timeout_s)
            return self._sent_count >= count

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(200):
                    if sock is self._zap:
                        self._authenticate(self._zap.recv_multipart())
                    else:
                        self._reply(*self._sock.recv_multipart(copy=True)[:2])
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close()
            self._zap.close()

    def _authenticate(self, frames: list[bytes]) -> None:
        """A ZAP request (RFC 27): only the client key issued for this sync passes."""
        version, request_id, *_, mechanism, key = frames[:7] if len(frames) >= 7 else (b"1.0", b"", b"", b"")
        ok = mechanism == b"CURVE" and secrets.compare_digest(key, z85.decode(self.client_public))
        if not ok:
            self.refused += 1
        status = (b"200", b"OK") if ok else (b"400", b"unknown key")
        self._zap.send_multipart([version, request_id, *status, b"", b""])

    def _reply(self, peer: bytes, data: bytes = b"") -> None:
        try:
            req = json.loads(data)
            if isinstance(req, dict) and "failed" in req:
                with self._sent:  # a worker's fetch failed: the trainer's wait ends (the worker says why)
                    self._failed = True
                    self._sent.notify_all()
                return
            index, offset, size = int(req["bucket"]), int(req["offset"]), int(req["size"])
        except (ValueError, TypeError, LookupError):
            return self._send(peer, [json.dumps({"error": "malformed request"}).encode()])
        buf = self._map(index)
        if buf is False:
            return self._send(peer, [json.dumps({"error": f"unknown bucket {index}"}).encode()])
        total = len(buf) if buf is not None else 0
        if not (0 <= offset <= total and 0 <= size <= CHUNK_BYTES and offset + size <= total):
            return self._send(peer, [json.dumps({"error": f"bad range ({offset}, {size})"}).encode()])
        head = json.dumps({"bucket": index, "offset": offset, "nbytes": total}).encode()
        chunk = memoryview(buf)[offset : offset + size] if size else b""
        if self._send(peer, [head, chunk], payload=size):
            if offset + size == total:
                with self._sent:
                    self._sent_count += 1
                    self._sent.notify_all()

    def _send(self, peer: bytes, frames: list, payload: int | None = None) -> bool:
        """Sends without blocking; counts `payload` bytes as one chunk sent when it went."""
        with self._counts:
            try:
                self._sock.send_multipart([peer, *frames], copy=False, flags=zmq.DONTWAIT)
            except zmq.Again:  # the peer's queue is at its HWM: it asked for more than its window
                self._dropped += 1
                return False
            except zmq.ZMQError:  # the peer is gone (EHOSTUNREACH)
                return False
            if payload is not None:
                self._bytes_sent += payload
                self._chunks_sent += 1
            return True

    def _map(self, index: int):
        """The bucket file's mapping (None when empty), False for an unknown bucket."""
        with self._lock:
            if index in self._maps:
                return self._maps[index]
            path = self._paths.get(index)
            if path is None:
                return False
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else None
            self._maps[index] = m
            return m

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)  # the thread closes its sockets
        if self._thread.is_alive():
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()
        with self._lock:
            self._maps.clear()

    def __enter__(self) -> ZmqBucketServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ZmqBucketClient:
    """The worker's side: one CURVE DEALER, `fetch(index, expected, allocate)` per bucket (the
    `stream.BucketClient` interface)."""

    def __init__(self, address: dict):
        try:
            self.endpoint = str(address["endpoint"])
            self.timeout_s = float(address.get("timeout_s", 30.0))
            keys = [str(address[k]).encode() for k in ("server_key", "public_key", "secret_key")]
            if any(len(k) != 40 for k in keys):
                raise ValueError("CURVE keys are 40 Z85 characters")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"weight sync (zmq): bad zmq address (endpoint, keys, timeout_s): {e}") from e
        self._ctx = zmq.Context(io_threads=1)
        s = self._sock = self._ctx.socket(zmq.DEALER)
        s.linger = 0
        s.sndhwm = s.rcvhwm = HWM
        s.maxmsgsize = CHUNK_BYTES + (1 << 16)
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys
        s.ipv6 = self.endpoint.startswith("tcp://[")
        self._monitor = s.get_monitor_socket(_HANDSHAKE_FAILED)
        self._poller = zmq.Poller()
        self._poller.register(s, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        try:
            s.connect(self.endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise StreamError(
                f"weight sync (zmq): cannot connect to the trainer at {self.endpoint}: {e}"
            ) from e

    def fetch(self, index: int, expected: int, allocate) -> tuple[object, int]:
        """Pulls bucket `index`, which must be `expected` bytes long (from its tensor list), in chunks;
        `allocate(nbytes)` returns a writable buffer, called once the announced size matched.
        Returns `(buffer, nbytes)`. After an error, replies may still be queued: close the client."""
        what = f"bucket {index} from {self.endpoint}"
        offsets = list(range(0, expected, CHUNK_BYTES)) or [0]
        asked, got, view, buf = 0, 0, None, None
        try:
            while asked < min(WINDOW, len(offsets)):
                self._ask(index, offsets[asked], expected)
                asked += 1
            for offset in offsets:
                head = self._recv_header(what, got, expected)
                if "error" in head:
                    raise StreamError(
                        f"weight sync (zmq): the trainer refused {what}: {str(head['error'])[:200]}"
                    )
                nbytes = head.get("nbytes")
                if head.get("bucket") != index or nbytes != expected or head.get("offset") != offset:
                    raise StreamError(
                        f"weight sync (zmq): the trainer announced {str(nbytes)[:40]} bytes at offset "
                        f"{str(head.get('offset'))[:40]} for {what}, expected {expected} at {offset}"
                    )
                if view is None:
                    buf = allocate(expected)
                    view = memoryview(buf).cast("B")[:expected] if expected else memoryview(bytearray())
                size = min(CHUNK_BYTES, expected - offset)
                n = self._sock.recv_into(view[offset : offset + size]) if size else len(self._sock.recv())
                if n != size:
                    raise StreamError(f"weight sync (zmq): a chunk of {what} has {n} bytes, expected {size}")
                got += size
                if asked < len(offsets):
                    self._ask(index, offsets[asked], expected)
                    asked += 1
            return buf, expected
        except StreamError:
            self._report_failure()
            raise

    def _ask(self, index: int, offset: int, expected: int) -> None:
        req = {"bucket": int(index), "offset": offset, "size": min(CHUNK_BYTES, expected - offset)}
        self._sock.send(json.dumps(req).encode(), flags=zmq.DONTWAIT)

    def _recv_header(self, what: str, got: int, expected: int) -> dict:
        """The next reply's JSON header; a clear error on a refused handshake or no reply in time."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            events = dict(self._poller.poll(max(0, deadline - time.monotonic()) * 1000))
            if self._monitor in events:
                event = recv_monitor_message(self._monitor)
                raise StreamError(
                    f"weight sync (zmq): the trainer at {self.endpoint} refused this worker's CURVE "
                    f"handshake (event {event['event']}, value {event['value']}): wrong or stale keys"
                )
            if self._sock in events:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"weight sync (zmq): no data from the trainer for {self.timeout_s:.1f} s while receiving "
                    f"{what} ({got} of {expected} bytes received)"
                )
        try:
            head = json.loads(self._sock.recv())
        except ValueError as e:
            raise StreamError(f"weight sync (zmq): malformed reply header in {what}: {e}") from e
        if not isinstance(head, dict):
            raise StreamError(f"weight sync (zmq): reply header of {what} is not a JSON object")
        return head

    def _report_failure(self) -> None:
        try:  # ends the trainer's wait for this sync's bytes early (best effort)
            self._sock.send(b'{"failed": 1}', flags=zmq.DONTWAIT)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
