"""The reference serving engine: paged KV cache, continuous batching, pool-backed prefix reuse.

One ``Engine`` owns a ``RefModel``, a bounded page pool and a queue of requests. Each
``step()`` runs one forward over a batch mixing every running decode (one token each) with
prefill chunks of waiting requests, up to ``max_batch_tokens`` (continuous batching; with
``chunk_tokens`` set, long prompts prefill over several steps: chunked prefill).

With a pool (``BlockPool``), a request first looks up its prompt's block hashes; the cached
prefix is read from the pool straight into the request's pages (``scatter_blocks``) and only
the missed tokens run. When a prompt's prefill completes, its full blocks are gathered from
the pages (``gather_blocks``) and stored. Roles:

* ``both``: prefill and decode here.
* ``prefill``: prefill, store the prompt's blocks, produce the first token, finish.
* ``decode``: take ``prompt + [first token]`` from a prefill worker, load the prefix from the
  pool (only the partial tail block is recomputed), decode the rest.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpool.connectors.paged_io import load_blocks, stage_blocks
from kvpool.connectors.pool_api import BlockPool, pool_spec
from kvpool.core.errors import CapacityExhausted, InvalidArgument
from kvpool.engine.model import ModelConfig, RefModel
from kvpool.kernels.paged import TORCH_DTYPES, PagedLayout, gather_blocks, scatter_blocks

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class EngineConfig:
    """Limits and behaviour of one engine instance."""

    num_pages: int = 2048
    page_tokens: int = 16
    block_tokens: int = 32  # pool block = block_tokens // page_tokens pages
    max_batch_tokens: int = 8192
    chunk_tokens: int | None = None  # None: a prompt prefills in one step
    max_running: int = 64
    role: str = "both"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidArgument(f"role {self.role!r} is not one of {ROLES}")
        if self.block_tokens % self.page_tokens:
            raise InvalidArgument("block_tokens must be a multiple of page_tokens")
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise InvalidArgument("chunk_tokens must be positive")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; otherwise softmax sampling (optionally top-k) from ``seed``."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0


@dataclass
class Request:
    """A request's life in the engine. ``output`` holds generated token ids."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pages
    hit_tokens: int = 0  # of which came from the pool
    prefill_tokens_run: int = 0  # tokens the model ran for this prompt
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    last_logits: torch.Tensor | None = None
    prompt_hashes: list[bytes] = field(default_factory=list, repr=False)  # set on admit with a pool

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


class PageAllocator:
    """A free list of page ids; O(1) alloc/free; refuses beyond ``num_pages``."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityExhausted(f"{n} pages wanted, {len(self._free)} free", hint="raise num_pages")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class Engine:
    """See the module docstring. Not thread-safe: one caller drives ``step()``."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        pool: BlockPool | None = None,
        clock_s: Callable[[], float] = time.perf_counter,
        model: RefModel | None = None,
    ) -> None:
        if model is not None and model.config != model_config:
            raise InvalidArgument("the model passed to Engine was built from another ModelConfig")
        self.model = model if model is not None else RefModel(model_config)
        self.config = config
        self.pool = pool
        self.clock_s = clock_s
        self.spec = self.model.kv_spec(config.block_tokens)  # revision = weight fingerprint
        held = pool_spec(pool) if pool is not None else None
        if held is not None:
            held.require_same(self.spec, "engine")
        self.layout = PagedLayout(config.page_tokens, model_config.num_kv_heads, model_config.head_dim, "NHD")
        dtype = TORCH_DTYPES[model_config.dtype]
        self.kv_caches = [
            torch.zeros(self.layout.page_shape(2, config.num_pages), dtype=dtype)
            for _ in range(model_config.num_layers)
        ]
        self.allocator = PageAllocator(config.num_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.load_errors = 0  # blocks the pool said it had but failed verification

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Request:
        ids = torch.as_tensor(prompt)
        if ids.numel() == 0:
            raise InvalidArgument("empty prompt")
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InvalidArgument(
                f"a prompt is one flat sequence of integer token ids, got shape {tuple(ids.shape)} of {ids.dtype}",
                hint="add one request per prompt (batched rows are separate requests)",
            )
        prompt = [int(t) for t in ids.tolist()]
        if max(prompt) >= self.model.config.vocab_size or min(prompt) < 0:
            raise InvalidArgument(f"token ids must be in [0, {self.model.config.vocab_size})")
        if self.config.role == "prefill":
            params = SamplingParams(1, params.temperature, params.top_k, params.seed)
        pages_needed = -(-(len(prompt) + params.max_new_tokens) // self.config.page_tokens)
        if pages_needed > self.config.num_pages:  # refused here: it could never be admitted
            raise CapacityExhausted(
                f"request {request_id} needs {pages_needed} pages, the engine has {self.config.num_pages}",
                hint="a shorter prompt or max_tokens, or a larger --num-pages",
            )
        req = Request(request_id, list(prompt), params, arrival_s=self.clock_s())
        self.waiting.append(req)
        return req

    def abort(self, req: Request) -> None:
        """Drop ``req`` (its caller went away): it leaves the queue or the batch and its pages
        are free for the next request. A finished or unknown request is left alone."""
        # by identity: a Request's dataclass equality compares its tensors
        self.waiting = deque(r for r in self.waiting if r is not req)
        if any(r is req for r in self.running):
            self.running = [r for r in self.running if r is not req]
            self.allocator.free(req.pages)
            req.pages = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run_until_done(self, max_steps: int = 1_000_000) -> list[Request]:
        for _ in range(max_steps):
            if not self.has_work():
                break
            self.step()
        return self.finished

    # -- pool ---------------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        total = len(req.prompt) + req.params.max_new_tokens
        pages_needed = -(-total // self.config.page_tokens)
        if pages_needed > self.allocator.free_pages:
            if not self.running:
                raise CapacityExhausted(f"request {req.request_id} needs {pages_needed} pages, engine has fewer")
            return False
        req.pages = self.allocator.alloc(pages_needed)
        if self.pool is not None:
            self._load_prefix(req)
        return True

    def _load_prefix(self, req: Request) -> None:
        assert self.pool is not None
        t = self.config.block_tokens
        hashes = req.prompt_hashes = self.pool.hashes(req.prompt)  # kept for _store_prompt
        usable = (len(req.prompt) - 1) // t  # the last prompt token always runs (it yields logits)
        want = self.pool.lookup(hashes[:usable]) if usable else 0
        if want == 0:
            return
        ppb = t // self.config.page_tokens

        def scatter(first: int, count: int, blocks: torch.Tensor) -> None:
            pages = req.pages[first * ppb : (first + count) * ppb]
            scatter_blocks(self.spec, self.layout, blocks, self.kv_caches, pages, count)

        # straight from the leased arena bytes into the pages (verified run by run), no buffer
        got = load_blocks(self.pool, self.spec, self.kv_caches[0].dtype, hashes[:want], scatter)
        self.load_errors += want - got
        req.computed = req.hit_tokens = got * t

    def _store_prompt(self, req: Request) -> None:
        if self.pool is None or self.config.role == "decode":
            return
        t = self.config.block_tokens
        full = len(req.prompt) // t
        first = req.hit_tokens // t
        if full <= first:
            return
        # gather only the blocks the pool does not hold yet: block i starts at page i * ppb
        ppb = t // self.config.page_tokens

        def gather(start: int, count: int, out: torch.Tensor) -> None:
            pages = req.pages[(first + start) * ppb : (first + start + count) * ppb]
            gather_blocks(self.spec, self.layout, self.kv_caches, pages, out, count)

        # straight into the put's arena slots, checksummed as they are written; then visible
        staged = stage_blocks(self.pool, self.spec, self.kv_caches[0].dtype, req.prompt_hashes[first:full], gather)
        if staged is not None:
            staged.commit()

    # -- one step -----------------------------------------------------------------------
    def _slots(self, req: Request, upto: int) -> torch.Tensor:
        pages = torch.tensor(req.pages, dtype=torch.long)
        pos = torch.arange(upto)
        return pages[pos // self.config.page_tokens] * self.config.page_tokens + pos % self.config.page_tokens

    def step(self) -> list[Request]:
        """Schedule, run one forward, sample; returns requests that finished in this step."""
        budget = self.config.max_batch_tokens
        batch: list[tuple[Request, int]] = []
        for req in self.running:
            if req.computed >= len(req.prompt) and budget > 0:  # decoding: one token
                batch.append((req, 1))
                budget -= 1
        for req in self.running:
            if req.computed < len(req.prompt) and budget > 0:  # a prefill in progress (chunked)
                n = self._chunk(req, budget)
                batch.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            n = self._chunk(req, budget)
            batch.append((req, n))
            budget -= n
        if not batch:
            return []
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[int, int, torch.Tensor]] = []
        offset = 0
        for req, n in batch:
            all_tokens = req.tokens
            start = req.computed
            tokens.extend(all_tokens[start : start + n])
            positions.extend(range(start, start + n))
            seqs.append((offset, n, self._slots(req, start + n)))
            offset += n
        logits = self.model.forward(
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            seqs,
            self.kv_caches,
            self.config.page_tokens,
        )
        done: list[Request] = []
        now = self.clock_s
        for i, (req, n) in enumerate(batch):
            was_prefill = req.computed < len(req.prompt)
            req.computed += n
            if was_prefill:
                req.prefill_tokens_run += n
                if req.computed < len(req.prompt):
                    continue  # more chunks to go
                self._store_prompt(req)
            req.last_logits = logits[i]
            req.output.append(self._sample(req, logits[i]))
            if req.first_token_s is None:
                req.first_token_s = now()
            if len(req.output) >= req.params.max_new_tokens:
                req.finish_s = now()
                done.append(req)
        for req in done:
            self.running.remove(req)
            self.allocator.free(req.pages)
            req.pages = []
            self.finished.append(req)
        return done

    def _chunk(self, req: Request, budget: int) -> int:
        n = len(req.prompt) - req.computed
        if self.config.chunk_tokens is not None:
            n = min(n, self.config.chunk_tokens)
        return min(n, budget)

    def _sample(self, req: Request, logits: torch.Tensor) -> int:
        p = req.params
        if p.temperature <= 0:
            return int(logits.argmax())
        scaled = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        # Seeded by (request seed, position), not a running generator: a decode worker that
        # takes over after a prefill worker draws exactly what one engine would have drawn.
        gen = torch.Generator().manual_seed(p.seed * 1_000_003 + len(req.tokens))
        return int(torch.multinomial(probs, 1, generator=gen))
