"""A stand-in SGLang HTTP server on 127.0.0.1 that speaks the wire contract of a chosen version (for CPU tests
of the client; the live tests against real SGLang are in test_sglang_live.py).

It answers ``/generate`` deterministically: the response is the prompt's ids reversed, cut to max_new_tokens,
with log-prob ``-0.5`` per token and finish reason "length"; it records every request it receives.

The disaggregated routes are real on the receiving side: ``/init_weights_update_group`` joins the trainer's group
(``redline.sync.broadcast.init_weight_update_group``, the construction SGLang uses), and each
``/update_weights_from_distributed`` receives the announced flattened bucket by broadcast, cuts it into the named
tensors and, given a ``hash_fn``, reports the hashes of the parameters SGLang would hold from ``/weights_checker``. A group member must not share
a process with the trainer's side of the group, so such tests run the stand-in in a process of its own
(``fake_sglang_process``; ``GET /fake/calls`` lists what it received).
"""

import contextlib
import json
import math
import multiprocessing
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


CONTROL_PATHS = ("/update_weights_from_tensor", "/weights_checker", "/release_memory_occupation",
                 "/resume_memory_occupation")


class FakeSGLangModel:
    """What an SGLang model is to a custom weight loader, made from an HF export: parameters in SGLang's layout
    (q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, the vocabulary rows padded to a multiple of
    64), zero until loaded, and a ``load_weights`` that places HF tensors the way SGLang's stacked-parameter
    mapping does. ``skip``: HF names ``load_weights`` leaves untouched (a loader that misses a tensor)."""

    STACKED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, export, skip=()):
        import torch

        self.skip = set(skip)
        self.rows: dict[str, list[int]] = {}  # stacked parameter -> rows of each shard, in shard order
        shapes: dict[str, tuple] = {}
        dtypes: dict[str, object] = {}
        for name, tensor in export:
            target, shard = self.place(name)
            if shard is None:
                rows = tensor.shape[0] + (-tensor.shape[0] % 64 if "embed_tokens" in name or "lm_head" in name
                                          else 0)
                shapes[target] = (rows, *tensor.shape[1:])
            else:
                self.rows.setdefault(target, [0] * 3)[shard] = tensor.shape[0]
                shapes[target] = (None, *tensor.shape[1:])
            dtypes[target] = tensor.dtype
        self.params = {name: torch.zeros(sum(self.rows[name]) if shape[0] is None else shape[0], *shape[1:],
                                         dtype=dtypes[name]) for name, shape in shapes.items()}

    def place(self, name):
        """``(SGLang parameter, shard id or None)`` of an HF name."""
        for stacked, part, shard in self.STACKED:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{stacked}."), shard
        return name, None

    def named_parameters(self):
        return iter(self.params.items())

    def load_weights(self, named):
        for name, tensor in named:
            if name in self.skip:
                continue
            target, shard = self.place(name)
            param = self.params[target]
            start = 0 if shard is None else sum(self.rows[target][:shard])
            param[start:start + tensor.shape[0]].copy_(tensor)


class Payloads:
    """Stands in for SGLang's CUDA-IPC serializer on the CPU: ``serialize`` keeps the object and returns a key,
    which a stand-in server in the same process turns back into it (``get``)."""

    def __init__(self):
        self.objects: dict[str, object] = {}

    def serialize(self, obj) -> str:
        key = f"payload-{len(self.objects)}"
        self.objects[key] = obj
        return key

    def get(self, key: str):
        return self.objects[key]


class FakeSGLang:
    def __init__(self, version="0.5.17", delay=0.0, busy_flushes=1, hash_fn=None, corrupt_bucket=None,
                 control_delay=0.0, loader_model=None, payloads=None, copies_payload=False, freeze_gc=True):
        self.freeze_gc = freeze_gc  # whether /freeze_gc exists (it does in 0.5.17)
        self.version, self.delay, self.busy_flushes, self.hash_fn = version, delay, busy_flushes, hash_fn
        # redline's checked loader (``--custom-weight-loader``): the model it loads into, the serialized payloads
        self.loader_model, self.payloads = loader_model, payloads
        self.copies_payload = copies_payload  # loads a copy of each payload, as a server on another GPU does
        # seconds each weight update, memory release / resume and /weights_checker takes to answer
        self.control_delay = control_delay
        self.corrupt_bucket = corrupt_bucket  # index of a received bucket whose first byte is flipped on arrival
        self.buckets_received = 0
        self.calls: list[tuple[str, dict | None]] = []
        self.session_open = False
        self.weight_version = "default"
        self.checksums: dict[str, str] = {}  # what /weights_checker reports (set by the test, or by received buckets)
        self.group, self.group_name = None, None
        self.lock = threading.Lock()
        self.generating, self.most_generating = 0, 0  # /generate calls being answered now, and the most at once
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
                if self.path in CONTROL_PATHS:
                    time.sleep(server.control_delay)
                status, answer = server.route(self.path, body)
                self.reply(status, answer)

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # many clients connect at once (socketserver's default backlog is 5)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def new_contract(self):
        return tuple(int(x) for x in self.version.split(".")) >= (0, 5, 21)

    def route(self, path, body):
        if path in ("/server_info", "/get_server_info"):
            info = {"version": self.version}
            if self.loader_model is not None:
                from redline.rollout.sglang.checked_load import LOADER

                info["custom_weight_loader"] = [LOADER]
            return (200, info) if path == "/server_info" else (404, {})
        if path == "/health":
            return 200, {}
        if path == "/generate":
            with self.lock:
                self.generating += 1
                self.most_generating = max(self.most_generating, self.generating)
            time.sleep(self.delay)
            with self.lock:
                self.generating -= 1
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
            if self.loader_model is not None:
                from redline.rollout.sglang.checked_load import LOADER, load_bucket

                if body["load_format"] != LOADER:
                    return 400, {"success": False, "message": f"unexpected load format {body['load_format']}"}
                [key] = body["serialized_named_tensors"]
                named = self.payloads.get(key)
                if self.buckets_received == self.corrupt_bucket:  # the first byte flipped on arrival
                    named[0][1][0] ^= 1
                self.buckets_received += 1
                if self.copies_payload:
                    named = [(name, tensor.clone()) for name, tensor in named]
                load_bucket(self.loader_model, named)
            self.weight_version = body.get("weight_version") or self.weight_version
            return 200, {"success": True, "message": "Success"}
        if path == "/flush_cache":
            if self.busy_flushes:
                self.busy_flushes -= 1
                return 400, "requests running"
            return 200, "Cache flushed"
        if path == "/init_weights_update_group":
            return self.join_group(body)
        if path == "/update_weights_from_distributed":
            if self.new_contract and not self.session_open:
                return 400, {"success": False, "message": "must run between begin_weight_update() and "
                                                          "end_weight_update()"}
            return self.receive_bucket(body)
        if path == "/destroy_weights_update_group":
            import torch.distributed as dist

            if body["group_name"] != self.group_name:
                return 400, {"success": False, "message": f"no group {body['group_name']}"}
            dist.destroy_process_group(self.group)
            self.group = self.group_name = None
            return 200, {"success": True, "message": ""}
        if path == "/freeze_gc" and self.freeze_gc:
            return 200, "Garbage collection frozen."
        if path == "/fake/calls":
            return 200, [p for p, _ in self.calls]
        if path == "/weights_checker":
            return 200, {"success": True, "message": "", "ranks": [{"checksums": self.checksums}]}
        if path in ("/release_memory_occupation", "/resume_memory_occupation", "/pause_generation",
                    "/continue_generation"):
            return 200, None
        return 404, {"detail": "Not Found"}

    def join_group(self, body):
        from redline.sync.broadcast import init_weight_update_group

        self.group = init_weight_update_group(body["master_address"], body["master_port"], body["rank_offset"],
                                              body["world_size"], body["group_name"], backend=body["backend"])
        self.group_name = body["group_name"]
        return 200, {"success": True, "message": ""}

    def receive_bucket(self, body):
        """One flattened bucket: the tensors' bytes back to back in the announced order (FlattenedTensorBucket)."""
        import torch
        import torch.distributed as dist

        if body["group_name"] != self.group_name or body.get("load_format") != "flattened_bucket":
            return 400, {"success": False, "message": f"unexpected group or load format: {body}"}
        dtypes = [getattr(torch, d) for d in body["dtypes"]]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(body["shapes"], dtypes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(flat, group_src=0, group=self.group)
        if self.buckets_received == self.corrupt_bucket:
            flat[0] ^= 1
        self.buckets_received += 1
        received, offset = [], 0
        for name, shape, dtype, size in zip(body["names"], body["shapes"], dtypes, sizes):
            received.append((name, flat[offset:offset + size].view(dtype).view(shape)))
            offset += size
        if self.hash_fn is not None:  # as SGLang holds them: a bucket never splits a fused parameter's parts
            from redline.rollout.sglang.weight_check import expected_checksums

            self.checksums.update(expected_checksums(received, self.hash_fn))
        self.weight_version = body.get("weight_version") or self.weight_version
        return 200, {"success": True, "message": "Success"}

    def paths(self):
        return [p for p, _ in self.calls if p not in ("/server_info", "/get_server_info", "/health")]

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _serve(urls, stop, options, server_cls=FakeSGLang):
    with server_cls(busy_flushes=0, **options) as server:
        urls.put(server.url)
        stop.wait()


@contextlib.contextmanager
def fake_sglang_process(version="0.5.17", server_cls=FakeSGLang, **options):
    """A ``FakeSGLang`` (or ``server_cls``, a subclass; no busy flushes; ``options`` as its constructor's) in a
    spawned process of its own; yields its URL."""
    context = multiprocessing.get_context("spawn")
    urls, stop = context.Queue(), context.Event()
    process = context.Process(target=_serve, args=(urls, stop, dict(version=version, **options), server_cls),
                              daemon=True)
    process.start()
    try:
        yield urls.get(timeout=120)
    finally:
        stop.set()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


class InterruptibleSGLang(FakeSGLang):
    """A ``FakeSGLang`` that generates one token per ``tick`` seconds and pauses as SGLang does with
    ``/pause_generation {"mode": "abort"}``: every running request ends (finish reason "abort", with the tokens it
    has, reporting the weight version that made them) and the call answers once none runs; a request that arrives
    while paused waits for ``/continue_generation``. It refuses a weight update while a request runs (HTTP 400),
    so a push that overlaps generation fails the caller. ``GET /fake/interrupted`` lists, for each abort, how many
    requests it cut that held tokens.

    ``short_prompts`` makes the stand-in, not the run's timing, decide which requests a push finds generating: of
    the requests that start between two pauses, those of the first ``short_prompts`` prompts (distinct input ids;
    a group's samples share theirs, so a group is short or long as a whole) run to their end; every other request
    is a long response: it generates its first token and then runs on, whatever the time, until a pause cuts it
    (one with a single token to go just finishes). None: every request runs to its end unless a pause cuts it."""

    def __init__(self, tick=0.002, short_prompts=None, **options):
        super().__init__(**options)
        self.tick, self.short_prompts = tick, short_prompts
        self.state = threading.Condition()
        self.paused, self.running, self.aborts = False, 0, 0
        self.short: set[tuple[int, ...]] = set()  # the prompts that run to their end, since the last pause
        self.interrupted: list[int] = []  # per abort: the requests it cut that held tokens

    def route(self, path, body):
        if path == "/generate":
            return self.generate(body)
        if path == "/pause_generation":
            with self.state:
                self.paused = True
                self.short.clear()
                if (body or {}).get("mode") == "abort":
                    self.aborts += 1
                    self.interrupted.append(0)
                    self.state.notify_all()  # the long responses wait for it
                self.state.wait_for(lambda: self.running == 0)
            return 200, None
        if path == "/continue_generation":
            with self.state:
                self.paused = False
                self.state.notify_all()
            return 200, None
        if path == "/fake/interrupted":
            with self.state:
                return 200, list(self.interrupted)
        if path in ("/update_weights_from_distributed", "/update_weights_from_tensor") and self.running:
            return 400, {"success": False, "message": f"weight update while {self.running} requests generate"}
        return super().route(path, body)

    def is_long(self, prompt: tuple[int, ...], n: int) -> bool:
        """Whether a request starting now (the state's lock held) runs until a pause cuts it."""
        if self.short_prompts is None or n < 2:
            return False
        if prompt in self.short or len(self.short) < self.short_prompts:
            self.short.add(prompt)
            return False
        return True

    def generate(self, body):
        n = body["sampling_params"]["max_new_tokens"]
        tokens = list(reversed(body["input_ids"]))[:n]
        with self.state:
            self.state.wait_for(lambda: not self.paused)
            self.running += 1
            aborts = self.aborts
            long = self.is_long(tuple(body["input_ids"]), n)
        try:
            out, reason = (self.long_response if long else self.response)(tokens, aborts)
            version = self.weight_version
        finally:
            with self.state:
                self.running -= 1
                self.state.notify_all()
        if reason == "abort" and not out:  # SGLang's answer for a request aborted before its prefill
            return 200, {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "Abort before "
                                                   "prefill"}, "prompt_tokens": 0, "completion_tokens": 0}}
        return 200, {"meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in out],
                                   "finish_reason": {"type": reason}, "weight_version": version}}

    def response(self, tokens: list[int], aborts: int) -> tuple[list[int], str]:
        """A token per tick to the end, unless an abort after ``aborts`` comes first."""
        out = []
        for token in tokens:
            time.sleep(self.tick)
            with self.state:
                if self.aborts != aborts:
                    return self.cut(out, aborts)
            out.append(token)
        return out, "length"

    def long_response(self, tokens: list[int], aborts: int) -> tuple[list[int], str]:
        """The first token (a pause waits for it), then nothing more until an abort after ``aborts``."""
        time.sleep(self.tick)
        with self.state:
            self.state.wait_for(lambda: self.aborts != aborts)
            return self.cut(tokens[:1], aborts)

    def cut(self, out: list[int], aborts: int) -> tuple[list[int], str]:
        """``out``, ended by the first abort after ``aborts`` (the state's lock held); counted if it holds tokens."""
        self.interrupted[aborts] += bool(out)
        return out, "abort"
