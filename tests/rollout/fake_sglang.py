"""A stand-in SGLang HTTP server on 127.0.0.1 that speaks the wire contract of a chosen version (for CPU tests
of the client; the live tests against real SGLang are in test_sglang_live.py).

It answers ``/generate`` deterministically: the response is the prompt's ids reversed, cut to max_new_tokens,
with log-prob ``-0.5`` per token and finish reason "length"; it records every request it receives.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeSGLang:
    def __init__(self, version="0.5.17", delay=0.0, busy_flushes=1):
        self.version, self.delay, self.busy_flushes = version, delay, busy_flushes
        self.calls: list[tuple[str, dict | None]] = []
        self.session_open = False
        self.weight_version = "default"
        self.checksums: dict[str, str] = {}  # what /weights_checker reports (set by the test)
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.handle_path(None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.handle_path(json.loads(self.rfile.read(length)) if length else None)

            def handle_path(self, body):
                with server.lock:
                    server.calls.append((self.path, body))
                status, answer = server.route(self.path, body)
                self.reply(status, answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def new_contract(self):
        return tuple(int(x) for x in self.version.split(".")) >= (0, 5, 21)

    def route(self, path, body):
        if path in ("/server_info", "/get_server_info"):
            return (200, {"version": self.version}) if path == "/server_info" else (404, {})
        if path == "/health":
            return 200, {}
        if path == "/generate":
            time.sleep(self.delay)
            n = body["sampling_params"]["max_new_tokens"]
            ids = list(reversed(body["input_ids"]))[:n]
            return 200, {"meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                                       "finish_reason": {"type": "length", "length": n},
                                       "weight_version": self.weight_version}}
        if path in ("/begin_weight_update", "/end_weight_update"):
            if not self.new_contract:
                return 404, {"detail": "Not Found"}
            self.session_open = path == "/begin_weight_update"
            return 200, {"success": True, "message": ""}
        if path == "/update_weights_from_tensor":
            if self.new_contract and not self.session_open:
                return 400, {"success": False, "message": "must run between begin_weight_update() and "
                                                          "end_weight_update()"}
            self.weight_version = body.get("weight_version") or self.weight_version
            return 200, {"success": True, "message": "Success"}
        if path == "/flush_cache":
            if self.busy_flushes:
                self.busy_flushes -= 1
                return 400, "requests running"
            return 200, "Cache flushed"
        if path == "/weights_checker":
            return 200, {"success": True, "message": "", "ranks": [{"checksums": self.checksums}]}
        if path in ("/release_memory_occupation", "/resume_memory_occupation", "/pause_generation",
                    "/continue_generation"):
            return 200, None
        return 404, {"detail": "Not Found"}

    def paths(self):
        return [p for p, _ in self.calls if p not in ("/server_info", "/get_server_info", "/health")]

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
