"""A per-run bearer token on every route of the vLLM servers rljax starts (or that are started like them).

vLLM's `--api-key` guards only `/v1/...`; the RL routes that dev mode adds (`/pause`, `/update_weights`,
`/collective_rpc`, `/start_weight_update`, ...) stay open to anyone who can reach the port, and
`/collective_rpc` runs any worker method. So rljax adds its own ASGI middleware with vLLM's
`--middleware rljax.rollout.auth.BearerTokenMiddleware`: every request except `GET /health` (the
liveness probe) must carry `Authorization: Bearer <token>`, else 401 before any route runs.

The token never appears on a command line (visible to every user in `ps`): the server reads it from the
file named by `RLJAX_SERVER_TOKEN_FILE` (mode 0600, refused if group or others can read it) when the app
is built, and fails to start without it (fail closed). The rljax client reads the same file
(`rollout.vllm.token_file` for servers started elsewhere, e.g. dedicated rollout nodes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat

TOKEN_FILE_ENV = "RLJAX_SERVER_TOKEN_FILE"
MIDDLEWARE = "rljax.rollout.auth.BearerTokenMiddleware"
OPEN_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health")})  # liveness probes (Slurm --wait-url)
SECRET_FLAGS = ("--api-key",)  # command-line flags whose values are redacted from rljax's logs


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def write_token_file(path: str | os.PathLike, token: str) -> str:
    """Writes `token` to `path` with mode 0600 (created that way, never widened; replaces an older file
    atomically, refusing to follow a symlink). Returns the path."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_token_file(path: str | os.PathLike) -> str:
    """The token in `path`; ValueError if the file is readable by group or others, or empty."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise ValueError(
                f"server token file {path} must be a regular file with mode 0600 (is {st.st_mode & 0o777:o})"
            )
        token = os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)
    if not token:
        raise ValueError(f"server token file {path} is empty")
    return token


def bearer_headers(token: str | None) -> dict[str, str]:
    """The request headers that carry `token` ({} without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def redact_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of every secret flag (`--api-key X`, `--api-key=X`) replaced by `***`."""
    out, hide = [], False
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if hide:
            out.append("***")
        elif flag in SECRET_FLAGS and "=" in arg:
            out.append(f"{flag}=***")
        else:
            out.append(arg)
        hide = arg in SECRET_FLAGS
    return out


class BearerTokenMiddleware:
    """Pure ASGI middleware: 401 unless `Authorization: Bearer <token>` matches (constant time).

    Built by vLLM (`app.add_middleware(BearerTokenMiddleware)`, no arguments) in the API server process;
    the token comes from the file named by `RLJAX_SERVER_TOKEN_FILE`, and a missing or unsafe file stops
    the server from starting.
    """

    def __init__(self, app, token: str | None = None):
        self.app = app
        if token is None:
            path = os.environ.get(TOKEN_FILE_ENV)
            if not path:
                raise RuntimeError(f"{MIDDLEWARE} needs {TOKEN_FILE_ENV} (a 0600 file holding the token)")
            token = read_token_file(path)
        self._digest = hashlib.sha256(token.encode()).digest()

    def _authorized(self, scope) -> bool:
        for key, value in scope.get("headers") or ():
            if key.lower() == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            return await self.app(scope, receive, send)
        if (scope.get("method"), scope.get("path")) in OPEN_ROUTES or self._authorized(scope):
            return await self.app(scope, receive, send)
        if kind == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "Unauthorized: missing or wrong bearer token"}).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
