"""A small upstream for `idem proxy`'s tests, in Python's standard library
only: it counts deliveries and effects per operation id (the
Idempotency-Key the proxy sends it), deduplicates on it as a careful
service would, and can be told, per request, to be slow, fail or crash.

Headers it obeys:
  x-test-delay-ms: N     sleep N ms before acting
  x-test-status: N       answer with status N (default 201)
  x-test-fail-first: N   the first N deliveries of an operation answer 503
  x-test-crash: 1        act, then close the connection without answering
  x-test-hop: 1          answer with a header named by Connection
  x-test-retry-after: S  answer with Retry-After: S

GET /_test/log answers {"deliveries": [...], "effects": {op: n}}.
Prints "upstream listening on PORT" once it listens.
"""

import json
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
DELIVERIES = []  # every request that reached the upstream
EFFECTS = {}  # operation id -> how many times its effect ran
ANSWERS = {}  # operation id -> (status, body) of its effect
COUNTER = [0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status, body, extra=()):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in extra:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            # The proxy stopped waiting (a timeout, a kill): the effect stands.
            self.close_connection = True

    def do_GET(self):
        if self.path == "/_test/log":
            with LOCK:
                body = json.dumps({"deliveries": DELIVERIES, "effects": EFFECTS}).encode()
            return self.answer(200, body)
        self.handle_any()

    def do_POST(self):
        self.handle_any()

    def do_PATCH(self):
        self.handle_any()

    def do_PUT(self):
        self.handle_any()

    def do_DELETE(self):
        self.handle_any()

    def handle_any(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        op = self.headers.get("idempotency-key")
        with LOCK:
            DELIVERIES.append(
                {
                    "op": op,
                    "method": self.command,
                    "path": self.path,
                    "body": body.decode("utf-8", "replace"),
                    "headers": [[k.lower(), v] for k, v in self.headers.items()],
                    "at": time.time(),
                }
            )
            delivery = sum(1 for d in DELIVERIES if d["op"] == op) if op else 1
        delay = int(self.headers.get("x-test-delay-ms") or 0)
        if delay:
            time.sleep(delay / 1000)
        if delivery <= int(self.headers.get("x-test-fail-first") or 0):
            return self.answer(503, b'{"error":"try again"}')
        status = int(self.headers.get("x-test-status") or 201)
        with LOCK:
            if op is not None and op in ANSWERS:
                status, out = ANSWERS[op]  # a repeat of an operation: no new effect
            else:
                COUNTER[0] += 1
                n = COUNTER[0]
                if op is not None:
                    EFFECTS[op] = EFFECTS.get(op, 0) + 1
                out = json.dumps(
                    {"n": n, "op": op, "method": self.command, "path": self.path,
                     "body": body.decode("utf-8", "replace")}
                ).encode()
                if op is not None and status < 500:
                    ANSWERS[op] = (status, out)
        if self.headers.get("x-test-crash"):
            # The effect happened; the answer never leaves.
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        n = json.loads(out)["n"]
        if self.headers.get("x-test-body-bytes"):
            # An answer of this many bytes.
            out = b"x" * int(self.headers.get("x-test-body-bytes"))
        extra = [
            ("Location", "/things/%d" % n),
            ("ETag", '"%d"' % n),
            ("X-Custom", "kept-%d" % n),
            ("Set-Cookie", "session=%s" % uuid.uuid4().hex),
            ("X-Request-Id", uuid.uuid4().hex),
        ]
        if self.headers.get("x-test-retry-after"):
            extra.append(("Retry-After", self.headers.get("x-test-retry-after")))
        if self.headers.get("x-test-hop"):
            # A header that belongs to this connection only (RFC 9110 7.6.1).
            extra += [("Connection", "X-Upstream-Hop"), ("X-Upstream-Hop", "1")]
        self.answer(status, out, extra)


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print("upstream listening on %d" % server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
