"""The reference engine behind a small OpenAI-style HTTP server: what ``kvpool demo`` runs as
a prefill or decode instance when vLLM is not installed.

    python -m kvpool.engine.server --role decode --listen 127.0.0.1:8101 --pool 127.0.0.1:7450

It speaks the subset of vLLM's ``/v1/completions`` that the demo router uses, so the router
drives this server and ``vllm.entrypoints.openai.api_server`` alike:

* ``POST /v1/completions`` ``{"prompt": [token ids] | "w1 w2 ..", "max_tokens", "temperature",
  "seed", "stream"}``; every choice carries ``token_ids`` (vLLM's ``return_token_ids``); the
  last chunk (or the reply) adds ``"kvpool": {"hit_tokens", "prefill_tokens_run"}``: what came
  from the pool and what ran. Streaming is SSE (``data: {...}`` ... ``data: [DONE]``).
* ``GET /v1/models``, ``GET /health``.

Roles (``Engine``): ``prefill`` runs the prompt, stores its full blocks in the pool, returns
the first token (vLLM ``kv_producer``); ``decode`` loads the cached prefix from the pool,
recomputes the rest, decodes and stores nothing (``kv_consumer``); ``both`` does all of it.

One thread drives the engine (``Engine`` is not thread-safe); the HTTP server
(``kvpool.rpc.http_json``: Starlette on uvicorn, bounded worker threads) hands requests to it
through a bounded queue and reads tokens back from a per-request queue. A client that goes
away mid-stream cancels its request: the engine drops it from the batch and frees its pages. A crash of the
engine thread fails every waiting request with its error and exits the process with status
1, so the supervisor reports it instead of a server that answers nothing.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from kvpool.connectors.pool_api import BlockPool, pool_spec
from kvpool.core.errors import CapacityExhausted, InvalidArgument, KVPoolError, Unavailable
from kvpool.core.supervisor import Supervisor
from kvpool.core.words import WordTokenizer
from kvpool.engine.engine import ROLES, Engine, EngineConfig, Request, SamplingParams
from kvpool.engine.model import ModelConfig, RefModel
from kvpool.rpc.http_json import HttpLimits, HttpServer, StreamFailed, Worker, http_status, json_reply, read_json

log = logging.getLogger(__name__)

MAX_QUEUED_REQUESTS = 256  # submissions waiting for the engine thread
MAX_NEW_TOKENS = 4096
IDLE_WAIT_S = 0.05


@dataclass
class _Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokens: queue.Queue[list[int] | BaseException | None]  # new tokens; None = finished
    request: Request | None = None
    sent: int = 0


class EngineLoop:
    """Owns the engine thread; ``submit`` is thread-safe."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Job] = queue.Queue(MAX_QUEUED_REQUESTS)
        self._jobs: list[_Job] = []
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._cancelled: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def submit(self, prompt: list[int], params: SamplingParams) -> _Job:
        if self.error is not None:
            raise Unavailable(f"the engine crashed: {self.error!r}")
        job = _Job(f"r{next(self._ids)}", prompt, params, queue.Queue())
        try:
            self._inbox.put_nowait(job)
        except queue.Full:
            raise Unavailable(f"{MAX_QUEUED_REQUESTS} requests already wait", hint="retry later") from None
        return job

    def cancel(self, job: _Job) -> None:
        """Stop generating for ``job`` (its client went away); thread-safe, a no-op once done."""
        self._cancelled.put(job)

    def stored_blocks(self, req: Request) -> int:
        """Blocks of ``req``'s prompt this engine offered to the pool (those it did not load)."""
        if self.engine.pool is None or self.engine.config.role == "decode":
            return 0
        t = self.engine.config.block_tokens
        return max(0, len(req.prompt) // t - req.hit_tokens // t)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                if not self.engine.has_work():
                    continue
                self.engine.step()
                self._publish()
        except BaseException as exc:  # crash loudly: fail the waiting requests, then the process
            self.error = exc
            log.exception("engine loop crashed")
            for job in self._jobs:
                job.tokens.put(exc)
            os._exit(1)

    def _drop_cancelled(self) -> None:
        while True:
            try:
                job = self._cancelled.get_nowait()
            except queue.Empty:
                return
            if job.request is not None:
                self.engine.abort(job.request)
            self._jobs = [j for j in self._jobs if j is not job]
            job.tokens.put(None)

    def _admit(self) -> None:
        self._drop_cancelled()
        block = not self.engine.has_work()
        while True:
            try:
                job = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            try:
                job.request = self.engine.add_request(job.request_id, job.prompt, job.params)
            except KVPoolError as err:
                job.tokens.put(err)
                continue
            self._jobs.append(job)

    def _publish(self) -> None:
        still = []
        for job in self._jobs:
            req = job.request
            assert req is not None
            if len(req.output) > job.sent:
                job.tokens.put(req.output[job.sent :])
                job.sent = len(req.output)
            if req.done:
                job.tokens.put(None)
            else:
                still.append(job)
        self._jobs = still


def parse_completion(body: dict[str, Any], tokenizer: WordTokenizer) -> tuple[list[int], SamplingParams, bool]:
    """The prompt, the sampling parameters and ``stream`` of a ``/v1/completions`` body."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise InvalidArgument("prompt must be a string or a list of token ids (one prompt per request)")
    max_tokens = int(body.get("max_tokens") or 16)
    if not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise InvalidArgument(f"max_tokens must be in [1, {MAX_NEW_TOKENS}]")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=float(body.get("temperature") or 0.0),
        top_k=int(body.get("top_k") or 0),
        seed=int(body.get("seed") or 0),
    )
    return ids, params, bool(body.get("stream"))


# a non-streamed reply waits for the whole completion
ENGINE_HTTP_LIMITS = HttpLimits(request_timeout_s=600.0)


def engine_app(
    loop: EngineLoop, model_name: str, tokenizer: WordTokenizer, limits: HttpLimits = ENGINE_HTTP_LIMITS
) -> Starlette:
    """The engine's routes (module docstring) as a Starlette app."""
    worker = Worker(limits)

    def error(status: int, err: BaseException) -> Response:
        message = err.message if isinstance(err, KVPoolError) else repr(err)
        if isinstance(err, KVPoolError):
            status = http_status(err, status)
        return json_reply(status, {"error": {"message": message, "type": type(err).__name__, "code": status}})

    def chunk(job: _Job, ids: list[int], finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": tokenizer.decode(ids), "token_ids": ids, "finish_reason": finish}
        obj: dict[str, Any] = {"id": job.request_id, "object": "text_completion", "model": model_name}
        obj["created"] = int(time.time())
        obj["choices"] = [choice]
        if finish is not None and job.request is not None:
            obj["kvpool"] = {
                "hit_tokens": job.request.hit_tokens,
                "prefill_tokens_run": job.request.prefill_tokens_run,
                "stored_blocks": loop.stored_blocks(job.request),
            }
            obj["usage"] = {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.request.output)}
        return obj

    def whole(job: _Job) -> Response:
        out: list[int] = []
        while (item := job.tokens.get()) is not None:
            if isinstance(item, BaseException):  # a request the engine refused is the caller's
                return error(400 if isinstance(item, (InvalidArgument, CapacityExhausted)) else 500, item)
            out.extend(item)
        return json_reply(200, chunk(job, out, "length"))

    def events(job: _Job) -> Iterator[dict[str, Any]]:
        while (item := job.tokens.get()) is not None:
            if isinstance(item, BaseException):
                raise StreamFailed({"error": {"message": repr(item), "type": type(item).__name__}})
            yield chunk(job, item, None)
        yield chunk(job, [], "length")

    async def get(request: HttpRequest) -> Response:
        path = request.url.path
        if path == "/health":
            return json_reply(200 if loop.error is None else 503, {"ok": loop.error is None})
        if path == "/v1/models":
            return json_reply(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
        return json_reply(404, {"error": {"message": f"no route GET {path}", "code": 404}})

    async def post(request: HttpRequest) -> Response:
        if request.url.path != "/v1/completions":
            return json_reply(404, {"error": {"message": f"no route POST {request.url.path}", "code": 404}})
        try:
            ids, params, stream = parse_completion(await read_json(request, limits), tokenizer)
            job = loop.submit(ids, params)
        except KVPoolError as err:
            return error(503 if isinstance(err, Unavailable) else 400, err)
        except (ValueError, TypeError) as exc:
            return error(400, InvalidArgument(f"bad request: {exc}"))
        if stream:  # the client gone mid-stream: the engine stops generating for it
            return worker.events(events(job), on_end=lambda: loop.cancel(job))
        try:
            return await worker.run(lambda: whole(job))
        except KVPoolError as err:
            loop.cancel(job)
            return error(504, err)

    routes = [Route("/{path:path}", get, methods=["GET"]), Route("/{path:path}", post, methods=["POST"])]
    return Starlette(routes=routes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvpool.engine.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT; port 0 = any (printed)")
    parser.add_argument("--pool", default="", help="pool daemon HOST:PORT; empty = no pool")
    parser.add_argument("--salt", default="", help="tenant salt of the pool namespace")
    parser.add_argument("--model-name", default="kvpool-ref-llama", help="the id /v1/models reports")
    parser.add_argument("--seed", type=int, default=0, help="model weight seed (same on every instance)")
    parser.add_argument("--num-layers", type=int, default=ModelConfig.num_layers)
    parser.add_argument("--num-pages", type=int, default=2048)
    parser.add_argument("--block-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=0, help="chunked prefill size; 0 = off")
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--no-reuse", action="store_true", help="never load a prefix from the pool (prompts still stored): a baseline"
    )
    return parser


class NoReusePool:
    """A ``BlockPool`` whose lookups miss: the engine recomputes every prompt but still
    stores its blocks (what a prefill instance of a disaggregated cluster without reuse does)."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self.spec = pool_spec(pool)

    def hashes(self, token_ids: Any) -> list[bytes]:
        return self._pool.hashes(token_ids)

    def lookup(self, hashes: Any) -> int:
        return 0

    def get_into(self, hashes: Any, out: Any) -> int:
        return 0

    def put(self, hashes: Any, blocks: Any) -> Any:
        return self._pool.put(hashes, blocks)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    model_config = ModelConfig(num_layers=args.num_layers, seed=args.seed)
    model = RefModel(model_config)
    config = EngineConfig(
        num_pages=args.num_pages,
        block_tokens=args.block_tokens,
        chunk_tokens=args.chunk_tokens or None,
        max_batch_tokens=args.max_batch_tokens,
        role=args.role,
    )
    pool: BlockPool | None = None
    if args.pool:
        from kvpool.client import PoolClient
        from kvpool.connectors.resilient_pool import ResilientPool
        from kvpool.core.clock import MonotonicClock
        from kvpool.core.spec import Namespace

        spec, salt = model.kv_spec(args.block_tokens), args.salt.encode()
        # a pool that goes away is a miss (recompute), never a failed request
        pool = ResilientPool(
            lambda: PoolClient.connect(args.pool, spec, salt=salt), Namespace(spec, salt), MonotonicClock(), 1000
        )
        pool.try_connect()
        if args.no_reuse:
            pool = NoReusePool(pool)
    loop = EngineLoop(Engine(model_config, config, pool, model=model))
    tokenizer = WordTokenizer.for_vocab(model_config.vocab_size)
    http = HttpServer(engine_app(loop, args.model_name, tokenizer), args.listen, ENGINE_HTTP_LIMITS, "engine")
    supervisor = Supervisor()  # SIGTERM/SIGINT end the wait below
    supervisor.install_stop_signals()
    loop.start()
    http.start()
    print(f"kvpool engine ({args.role}): http://{http.address}", flush=True)
    try:
        supervisor.wait_for_stop()
    finally:
        http.stop()  # joins the server (open streams get its grace) before the engine stops
        loop.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
