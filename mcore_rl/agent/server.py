"""The OpenAI-compatible endpoint of a run's agent sessions (:mod:`mcore_rl.agent.sessions`): any agent runtime
whose client takes a base URL (the ``openai`` package, LangChain, a user's script) drives a session through
``/v1/chat/completions`` and ``/v1/models``, and may set its reward.

Each session has its own base URL, ``http://HOST:PORT/sessions/<id>/v1``, so an unmodified client records into
the right trajectory. Every request needs the run's token (``Authorization: Bearer <token>``, the client's
``api_key``); the server listens on loopback unless told otherwise. Python's threading HTTP server: one thread
per connection, bodies read up to a size limit, an idle connection dropped after a timeout; an error in a
request is that request's answer, never the driver's.
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import secrets
import threading
import time

from mcore_rl.agent.sessions import RequestError, Sessions

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20  # a request's JSON: far past a long conversation, short of the driver's memory
IDLE_S = 300.0  # a connection that sends nothing for this long is closed


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}.get(status)
    return {"error": {"message": message, "type": kind or "invalid_request_error", "param": param, "code": None}}


class AgentServer:
    """``sessions`` served over HTTP on ``host:port`` (port 0: a free one) with a fresh per-run token."""

    def __init__(self, sessions: Sessions, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.sessions, self.token = sessions, token or secrets.token_urlsafe(32)
        self._http = http.server.ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self.host, self.port = self._http.server_address[:2]
        self._thread = threading.Thread(target=self._http.serve_forever, name="agent-server", daemon=True)
        self._thread.start()

    def base_url(self, sid: str) -> str:
        """Session ``sid``'s OpenAI base URL."""
        return f"http://{self.host}:{self.port}/sessions/{sid}/v1"

    def answer(self, method: str, path: str, authorization: str, body: bytes) -> tuple[int, dict]:
        """The status and JSON answer of one request."""
        expected = f"Bearer {self.token}"
        if not hmac.compare_digest(authorization.encode(), expected.encode()):
            return 401, error_body("expected the run's token as the API key (Authorization: Bearer ...)", 401)
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 3 or parts[0] != "sessions":
            return 404, error_body(f"no route {path!r}: expected /sessions/<id>/v1/...", 404)
        sid, route = parts[1], "/".join(parts[2:])
        try:
            if method == "GET" and route == "v1/models":
                self.sessions.check_running(sid)
                model = {"id": self.sessions.model, "object": "model", "created": 0, "owned_by": "mcore-rl"}
                return 200, {"object": "list", "data": [model]}
            if method != "POST" or route not in ("v1/chat/completions", "reward"):
                return 404, error_body(f"no route {method} {path!r}", 404)
            try:
                request = json.loads(body)
            except ValueError as err:
                raise RequestError(f"the request body is not JSON: {err}") from None
            if route == "reward":
                if not isinstance(request, dict) or "reward" not in request:
                    raise RequestError('expected {"reward": <number>}', param="reward")
                self.sessions.set_reward(sid, request["reward"])
                return 200, {"session": sid, "reward": request["reward"]}
            return 200, self.sessions.chat(sid, request)
        except RequestError as err:
            return err.status, error_body(str(err), err.status, err.param)
        except Exception as err:  # noqa: BLE001 - the request's answer, never the driver's crash
            log.exception("agent endpoint: %s %s", method, path)
            return 500, {"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error", "code": None}}

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()


def _handler(server: AgentServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: an agent's requests reuse one connection
        timeout = IDLE_S

        def do_GET(self):  # noqa: N802 - http.server's name
            self._serve(b"")

        def do_POST(self):  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                message = f"Content-Length: expected at most {MAX_BODY_BYTES} bytes"
                return self._send(413, error_body(message, 413), close=True)
            self._serve(self.rfile.read(length))

        def _serve(self, body: bytes):
            start = time.monotonic()
            status, answer = server.answer(self.command, self.path, self.headers.get("Authorization", ""), body)
            self._send(status, answer)
            log.debug("agent endpoint %s %s: %d in %.2f s", self.command, self.path, status, time.monotonic() - start)

        def _send(self, status: int, answer: dict, close: bool = False):
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # noqa: A002 - http.server's signature; its access log is debug
            log.debug("agent endpoint: " + format, *args)

    return Handler
