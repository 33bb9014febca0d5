"""An OpenAI-compatible front door on the router: ``/v1/completions``, ``/v1/chat/completions``
(both with ``stream``), ``/v1/models``; prefill/decode disaggregation decided per request.

The handshake (vLLM's disaggregated-prefill proxy pattern, the KV pushed through the pool):

1. The front door tokenizes the prompt (``WordTokenizer``) and asks ``RouterCore`` where it
   goes. ``SplitPolicy``: a prompt whose *uncached* part (prompt minus the prefix the pool
   holds, as the pool's KV events tell the router) is at most ``local_prefill_tokens``
   prefills on the decode instance itself (short or well-cached: no second hop); a longer
   one prefills on a prefill instance. While the decode instance has requests decoding, the
   limit is ``busy_local_prefill_tokens``: a local prefill runs as one engine step and every
   running decode waits for it, so only small ones may interrupt decoding.
2. Remote prefill: ``POST prefill/v1/completions`` with ``max_tokens: 1``. The prefill
   instance (vLLM ``kv_producer`` with ``KvpoolConnector``, or the reference engine's
   ``prefill`` role) writes the prompt's full blocks into the pool and answers.
3. ``POST decode/v1/completions`` with the same prompt and the caller's ``max_tokens``. The
   decode instance (``kv_consumer``) looks the prompt up in the pool, loads the cached prefix
   and recomputes only what is not there (at least the last token: it yields the logits),
   then streams the tokens, which the front door relays as SSE.

Why this and not SGLang's bootstrap handshake (decode reserves memory, prefill pushes into
it directly): the pool decouples the two: no prefill->decode connection, no decode memory
held while a prefill queues, and a block the pool keeps is reused by the next request that
shares the prefix. The cost: the decode instance re-reads the prompt's KV from the pool
(one copy out of shared memory) and recomputes the partial last block.

Failures: an instance that cannot be reached or fails mid-stream fails *its* requests with
``{"error": {"type": "engine_unavailable", "message": "decode instance decode-0 (URL)
failed: ..."}}`` (HTTP 503, or an SSE ``error`` event once streaming began), is marked down
and skipped by ``SplitPolicy`` until its ``/health`` answers again; other requests go on.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import urlsplit

import numpy as np

from kvpool.core.errors import InvalidArgument, KVPoolError, NotFound, Unavailable
from kvpool.core.words import WordTokenizer, render_chat
from kvpool.rpc.http_json import JsonHandler
from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, explain
from kvpool.scheduler.router_core import RouterCore, WorkerLoad

log = logging.getLogger(__name__)

RouteMode = Literal["auto", "local", "remote"]
ROUTE_MODES: tuple[RouteMode, ...] = ("auto", "local", "remote")
MAX_TOKENS_LIMIT = 4096
ENGINE_TIMEOUT_S = 600.0  # one engine call; a CPU vLLM under load is slow, a dead one fails at once
HEALTH_INTERVAL_S = 1.0


class EngineUnavailable(Unavailable):
    """An engine instance could not be reached or failed while serving a request."""


@dataclass(frozen=True)
class Instance:
    """An engine the front door sends work to; ``name`` is its RouterCore instance name."""

    name: str
    url: str  # http://host:port


class SplitPolicy(Policy):
    """Prefill on the decode instance when the uncached part is short, else on a prefill
    instance; decode on the least-loaded decode instance that is up (see the module docstring)."""

    name = "split"

    def __init__(
        self, local_prefill_tokens: int, mode: RouteMode = "auto", busy_local_prefill_tokens: int | None = None
    ) -> None:
        if local_prefill_tokens < 0 or (busy_local_prefill_tokens is not None and busy_local_prefill_tokens < 0):
            raise InvalidArgument("local_prefill_tokens and busy_local_prefill_tokens must be >= 0")
        self.local_prefill_tokens = local_prefill_tokens
        # While the decode instance is decoding, a local prefill stalls every running decode for
        # as long as it runs (one engine step): only prefill this many uncached tokens there then.
        self.busy_local_prefill_tokens = (
            local_prefill_tokens if busy_local_prefill_tokens is None else busy_local_prefill_tokens
        )
        self.mode: RouteMode = mode
        self.down: set[int] = set()  # members marked down by the front door

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        decode = [int(m) for m in state.decode_arr if int(m) not in self.down]
        if not decode:
            return Decision.reject("no decode instance is up")
        load = [(int(state.decode_active[m]), int(state.decode_context_tokens[m]), m) for m in decode]
        d = min(load)[2]
        lens = state.prefix_lengths(req.hashes)
        hit = req.cached_tokens(int(state.reachable_blocks(lens)[d]), state.spec.block_tokens)
        uncached = req.input_tokens - hit
        prefill = [int(m) for m in state.prefill_arr if int(m) not in self.down]
        running = int(state.decode_active[d])
        limit = min(self.local_prefill_tokens, self.busy_local_prefill_tokens) if running else self.local_prefill_tokens
        remote = self.mode == "remote" or (self.mode == "auto" and uncached > limit)
        if remote and prefill:
            p = int(prefill[int(np.argmin(state.queues_ms(np.array(prefill))))])
            why = f"uncached {uncached} tokens > {limit} ({running} decoding there): prefill instance"
            return explain(state, req, p, "instance", d, lens, why)
        if self.mode == "remote":
            return Decision.reject("no prefill instance is up (route mode 'remote')")
        return explain(state, req, d, "decode_local", d, lens, f"uncached {uncached} tokens: prefill on decode")


# ---- talking to an engine ----------------------------------------------------------------
def _connection(inst: Instance, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(inst.url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)


def _open(inst: Instance, role: str, body: dict[str, Any], timeout_s: float) -> http.client.HTTPResponse:
    try:
        conn = _connection(inst, timeout_s)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        raise EngineUnavailable(f"{role} instance {inst.name} ({inst.url}) failed: {exc!r}") from None
    if resp.status != 200:
        text = resp.read(4096).decode(errors="replace")
        raise EngineUnavailable(f"{role} instance {inst.name} ({inst.url}) answered {resp.status}: {text}")
    return resp


def complete(inst: Instance, role: str, body: dict[str, Any], timeout_s: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
    resp = _open(inst, role, {**body, "stream": False}, timeout_s)
    try:
        return dict(json.loads(resp.read()))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise EngineUnavailable(f"{role} instance {inst.name} ({inst.url}) failed mid-reply: {exc!r}") from None


def stream(
    inst: Instance, role: str, body: dict[str, Any], timeout_s: float = ENGINE_TIMEOUT_S
) -> Iterator[dict[str, Any]]:
    """The SSE events of a streamed completion, until ``[DONE]``; opens the stream before
    the first ``next`` so a dead engine fails before the caller answers its client."""
    resp = _open(inst, role, {**body, "stream": True}, timeout_s)

    def events() -> Iterator[dict[str, Any]]:
        try:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise EngineUnavailable(f"{role} instance {inst.name} ({inst.url}) failed: {event['error']}")
                yield event
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise EngineUnavailable(f"{role} instance {inst.name} ({inst.url}) failed mid-stream: {exc!r}") from None
        raise EngineUnavailable(f"{role} instance {inst.name} ({inst.url}) ended the stream without [DONE]")

    return events()


def healthy(inst: Instance, timeout_s: float = 2.0) -> bool:
    try:
        conn = _connection(inst, timeout_s)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False


# ---- the front door ----------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One client request, parsed: what the engines get and how to answer."""

    token_ids: list[int]
    engine_body: dict[str, Any]  # max_tokens, temperature, ... (no prompt, no stream)
    stream: bool
    chat: bool
    route: RouteMode | None  # a per-request override (``"kvpool": {"route": ..}``)


class FrontDoor:
    """The OpenAI surface over ``RouterCore`` + ``SplitPolicy`` and the engine instances."""

    def __init__(
        self,
        core: RouterCore,
        policy: SplitPolicy,
        instances: list[Instance],
        tokenizer: WordTokenizer,
        model_name: str,
    ) -> None:
        self.core, self.policy, self.tokenizer, self.model_name = core, policy, tokenizer, model_name
        self.instances = {i.name: i for i in instances}
        missing = set(self.instances) - set(core.names)
        if missing:
            raise InvalidArgument(f"instances {sorted(missing)} are not in the router's {core.names}")
        self._lock = threading.Lock()
        self._active: dict[str, int] = dict.fromkeys(self.instances, 0)
        self._context_tokens: dict[str, int] = dict.fromkeys(self.instances, 0)  # prompt + max_tokens in flight
        self._ids = itertools.count(1)
        self.counters: dict[str, int] = {"requests": 0, "local": 0, "remote": 0, "failed": 0, "hit_tokens": 0}
        self.counters["prompt_tokens"] = 0

    # ---- parsing --------------------------------------------------------------------
    def parse(self, body: dict[str, Any], chat: bool) -> Job:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InvalidArgument("messages must be a non-empty list")
            for m in messages:
                if (
                    not isinstance(m, dict)
                    or not isinstance(m.get("role"), str)
                    or not isinstance(m.get("content"), str)
                ):
                    raise InvalidArgument("each message needs a string role and a string content")
            ids = self.tokenizer.encode(render_chat(messages))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise InvalidArgument("prompt must be a string or a list of token ids (one prompt per request)")
        if not ids:
            raise InvalidArgument("the prompt is empty")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidArgument(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}]")
        # greedy unless the caller asks for sampling (OpenAI's default is 1.0): the demo's
        # answers are reproducible and the same on every path and engine
        engine_body: dict[str, Any] = {"max_tokens": max_tokens, "return_token_ids": True, "temperature": 0.0}
        for key in ("temperature", "top_k", "seed", "ignore_eos"):
            if body.get(key) is not None:
                engine_body[key] = body[key]
        ext = body.get("kvpool") or {}
        route = ext.get("route") if isinstance(ext, dict) else None
        if route is not None and route not in ROUTE_MODES:
            raise InvalidArgument(f"kvpool.route must be one of {ROUTE_MODES}")
        return Job(ids, engine_body, bool(body.get("stream")), chat, route)

    # ---- serving --------------------------------------------------------------------
    def _place(self, job: Job) -> tuple[Instance | None, Instance, int]:
        """(prefill instance or None for decode-local, decode instance, expected hit tokens)."""
        req = self.core.request_from(job.token_ids, None, 0, int(job.engine_body["max_tokens"]), None)
        with self._lock:
            mode, self.policy.mode = self.policy.mode, job.route or self.policy.mode
            try:
                result = self.core.route(req)
            finally:
                self.policy.mode = mode
        if result.decision.rejected:
            raise EngineUnavailable(f"no placement: {result.decision.reason}", hint="start or restart an engine")
        decode = self.instances[result.decode_instance]
        local = result.decision.prefill_kind == "decode_local"
        return (None if local else self.instances[result.prefill_instance]), decode, result.expected_hit_tokens

    def _mark_down(self, inst: Instance, err: KVPoolError) -> None:
        log.warning("%s: marked down until /health answers: %s", inst.name, err.message)
        with self._lock:
            self.policy.down.add(self.core.names.index(inst.name))

    def _busy(self, inst: Instance, delta: int, tokens: int) -> None:
        """Count a request (``tokens``: its prompt + max_tokens) in (+1) or out (-1) of ``inst``
        and report the instance's real load, replacing what the router charged at placement."""
        with self._lock:
            self._active[inst.name] += delta
            self._context_tokens[inst.name] += delta * tokens
            n, ctx = self._active[inst.name], self._context_tokens[inst.name]
        self.core.report(WorkerLoad(inst.name, outstanding_requests=n, active_requests=n, context_tokens=ctx))

    def serve(self, job: Job) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """Run ``job``: yields (new token ids, kvpool info so far) per engine chunk. Raises
        ``EngineUnavailable`` (after marking the instance down) when an engine fails."""
        prefill, decode, hit = self._place(job)
        info: dict[str, Any] = {
            "prefill": prefill.name if prefill else "decode-local",
            "decode": decode.name,
            "expected_hit_tokens": hit,
        }
        with self._lock:
            self.counters["requests"] += 1
            self.counters["remote" if prefill else "local"] += 1
            self.counters["prompt_tokens"] += len(job.token_ids)
        body = {**job.engine_body, "model": self.model_name, "prompt": job.token_ids}
        tokens = len(job.token_ids) + int(job.engine_body["max_tokens"])
        current = decode
        try:
            if prefill is not None:
                current = prefill
                self._busy(prefill, 1, tokens)
                try:
                    first = complete(prefill, "prefill", {**body, "max_tokens": 1})
                finally:
                    self._busy(prefill, -1, tokens)
                info["prefill_first_token"] = first["choices"][0].get("token_ids", [])
                done = first.get("kvpool") or {}  # the reference engine says what it did; vLLM does not
                info["prefill_instance_tokens_run"] = done.get("prefill_tokens_run")
                info["prefill_instance_hit_tokens"] = done.get("hit_tokens")
                info["prefill_stored_blocks"] = done.get("stored_blocks")
                current = decode
            self._busy(decode, 1, tokens)
            try:
                for event in stream(decode, "decode", body):
                    usage = event.get("usage") or {}
                    if "kvpool" in event:
                        info["hit_tokens"] = event["kvpool"].get("hit_tokens")
                        info["prefill_tokens_run"] = event["kvpool"].get("prefill_tokens_run")
                    elif usage.get("prompt_tokens_details"):  # vLLM: what its cache (or the pool) held
                        info["hit_tokens"] = usage["prompt_tokens_details"].get("cached_tokens")
                    for choice in event.get("choices", []):
                        yield list(choice.get("token_ids") or []), info
            finally:
                self._busy(decode, -1, tokens)
        except EngineUnavailable as err:
            with self._lock:
                self.counters["failed"] += 1
            self._mark_down(current, err)
            raise
        with self._lock:
            self.counters["hit_tokens"] += int(info.get("hit_tokens") or 0)

    def check_down(self) -> None:
        """Bring instances marked down back once their ``/health`` answers (one pass)."""
        with self._lock:
            down = [self.core.names[m] for m in self.policy.down]
        for name in down:
            inst = self.instances.get(name)
            if inst is not None and healthy(inst):
                log.info("%s: /health answers again, back in rotation", name)
                with self._lock:
                    self.policy.down.discard(self.core.names.index(name))

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "kvpool"}]}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.counters,
                "active": dict(self._active),
                "down": sorted(self.core.names[m] for m in self.policy.down),
            }

    def new_id(self, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"


def _chunk(door: FrontDoor, job: Job, rid: str, text: str, finish: str | None, first: bool) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": door.model_name}
    if job.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        obj.update(object="chat.completion.chunk", choices=[{"index": 0, "delta": delta, "finish_reason": finish}])
    else:
        obj.update(object="text_completion", choices=[{"index": 0, "text": text, "finish_reason": finish}])
    return obj


def handler_for(door: FrontDoor, fallback: Callable[[BaseHTTPRequestHandler], bool] | None = None) -> type:
    """The HTTP handler class; ``fallback`` gets requests this one does not know (the hook
    through which other routes, e.g. a /metrics page, join the same server)."""

    class Handler(JsonHandler):
        server_version = "kvpool-router-openai/1"

        def _error(self, err: KVPoolError) -> None:
            status = 503 if isinstance(err, Unavailable) else 404 if isinstance(err, NotFound) else 400
            kind = "engine_unavailable" if isinstance(err, Unavailable) else "invalid_request_error"
            self.send_json(status, {"error": {"message": str(err), "type": kind, "code": status}})

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self.send_json(200, door.models())
            elif self.path == "/v1/stats":
                self.send_json(200, {**door.stats(), "router": door.core.stats()})
            elif self.path == "/health":
                self.send_json(200, {"ok": True})
            elif fallback is None or not fallback(self):
                self._error(NotFound(f"no route GET {self.path}", hint="GET /v1/models"))

        def do_POST(self) -> None:
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                if fallback is None or not fallback(self):
                    self._error(NotFound(f"no route POST {self.path}", hint="POST /v1/completions"))
                return
            chat = self.path == "/v1/chat/completions"
            try:
                job = door.parse(self.read_json(), chat)
                tokens = door.serve(job)
                # the first chunk before any header: a dead engine is still a clean 503
                first = next(tokens, None)
            except KVPoolError as err:
                self._error(err)
                return
            except (ValueError, TypeError) as exc:
                self._error(InvalidArgument(f"bad request: {exc}"))
                return
            rid = door.new_id(chat)
            if job.stream:
                self._stream(job, rid, first, tokens)
            else:
                self._whole(job, rid, first, tokens)

        def _whole(self, job: Job, rid: str, first: Any, rest: Iterator[tuple[list[int], dict[str, Any]]]) -> None:
            ids: list[int] = []
            info: dict[str, Any] = {}
            try:
                for new, latest in itertools.chain([first] if first else [], rest):
                    ids.extend(new)
                    info = latest
            except KVPoolError as err:
                self._error(err)
                return
            text = door.tokenizer.decode(ids)
            obj: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": door.model_name}
            usage = {"prompt_tokens": len(job.token_ids), "completion_tokens": len(ids)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            if job.chat:
                message = {"role": "assistant", "content": text}
                obj.update(
                    object="chat.completion", choices=[{"index": 0, "message": message, "finish_reason": "length"}]
                )
            else:
                obj.update(object="text_completion", choices=[{"index": 0, "text": text, "finish_reason": "length"}])
            self.send_json(200, {**obj, "usage": usage, "kvpool": {**info, "token_ids": ids}})

        def _stream(self, job: Job, rid: str, first: Any, rest: Iterator[tuple[list[int], dict[str, Any]]]) -> None:
            self.start_events()
            sent = 0
            info: dict[str, Any] = {}
            try:
                for new, info in itertools.chain([first] if first else [], rest):
                    if not new:
                        continue
                    text = ("" if sent == 0 else " ") + door.tokenizer.decode(new)
                    self.send_event(
                        {
                            **_chunk(door, job, rid, text, None, sent == 0),
                            "kvpool": {"token_ids": new, "decode": info.get("decode")},
                        }
                    )
                    sent += len(new)
                final = _chunk(door, job, rid, "", "length", False)
                self.send_event({**final, "kvpool": info, "usage": {"prompt_tokens": len(job.token_ids)}})
                self.end_events()
            except KVPoolError as err:
                self.send_event({"error": {"message": str(err), "type": "engine_unavailable", "code": 503}})
            except OSError:  # the client went away: let go of the engine's stream now
                close = getattr(rest, "close", None)
                if close is not None:
                    close()
                return
            self.wfile.flush()

    return Handler


class FrontDoorServer:
    """The front door's HTTP server plus the thread that brings downed instances back."""

    def __init__(self, door: FrontDoor, listen: str) -> None:
        self.door = door
        host, _, port = listen.rpartition(":")
        self._httpd = ThreadingHTTPServer((host, int(port)), handler_for(door))
        self._httpd.daemon_threads = True
        self.address = f"{host}:{self._httpd.server_address[1]}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._httpd.serve_forever, name="openai-http", daemon=True),
            threading.Thread(target=self._health_loop, name="openai-health", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _health_loop(self) -> None:
        while not self._stop.wait(HEALTH_INTERVAL_S):
            try:
                self.door.check_down()
            except Exception:  # a probe must never stop the loop that brings instances back
                log.exception("health check failed")

    def stop(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(5)


__all__ = ["EngineUnavailable", "FrontDoor", "FrontDoorServer", "Instance", "SplitPolicy", "handler_for"]
