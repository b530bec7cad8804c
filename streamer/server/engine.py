"""The generation engine: one model, a few sequence slots (--parallel), one worker thread that decodes every
running request together (continuous batching) and takes new ones from a bounded FIFO queue. Each slot keeps
its KV cache between requests: a prompt that starts with what a free slot holds (the usual multi-turn chat)
goes to that slot and prefills only the rest, as llama-server's cache_prompt.

Each turn of the worker: requests whose client is gone leave; queued requests take free slots; every decoding
request samples its next token; then one forward (Model.forward_many) runs those tokens together with a chunk
of each prompt being prefilled (Model.ubatch tokens in all, BUSY_CHUNK while others decode): each layer's
experts are read once for all of them. A new request so joins at the next step, running streams keep flowing
while a long prompt is prefilled chunk by chunk, several new prompts share their expert reads, and a finished
or cancelled request frees its slot at once. Sampling settings, seeds, penalties and stop strings are per
request.

Jobs talk to the HTTP side through a callback (`emit(kind, payload)`), called from the worker thread:
("delta", (reasoning, content)) pieces, then exactly one ("done", Result) or ("error", APIError)."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from streamer.errors import ModelFileChanged, StreamerError
from streamer.generate import Generator, feed_together
from streamer.sampler import Sampler, SamplerParams
from streamer.server.schemas import APIError, GenRequest
from streamer.server.text import StopMatcher, ThinkSplitter

log = logging.getLogger(__name__)

# Tokens in a worker turn's forward while requests decode (theirs and the prompt chunks beside them): each of
# their steps waits for it (the 30B-A3B in RAM prefills 25-30 tok/s here: about 2 s), where a whole Model.ubatch
# would stall them for 20 s.
BUSY_CHUNK = 64


@dataclass
class Result:
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int  # tokens of the prompt in the context
    cached_tokens: int  # of which were reused from the KV cache
    completion_tokens: int
    prompt_s: float
    gen_s: float
    reasoning: str = ""
    content: str = ""

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Job:
    req: GenRequest
    emit: Callable[[str, object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Counters:
    """Totals since start, for /metrics."""

    requests: dict = field(default_factory=lambda: {"ok": 0, "cancelled": 0, "error": 0, "rejected": 0})
    prompt_tokens: int = 0  # prefilled
    cached_tokens: int = 0  # reused from the KV cache
    completion_tokens: int = 0
    prompt_s: float = 0.0
    gen_s: float = 0.0
    last_prompt_tps: float = 0.0
    last_gen_tps: float = 0.0


class QueueFull(Exception):
    pass


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Reply:
    """One request's output as it is generated: token pieces through the stop strings and the think splitter
    to the client (emit), the reply's text kept for the replies memory."""

    def __init__(self, job: Job, tok):
        self.job, self.req = job, job.req
        self.dec, self.stops, self.think = (
            tok.stream_decoder(),
            StopMatcher(job.req.stops),
            ThinkSplitter(job.req.think),
        )
        self.parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        self.raw: list[str] = []  # the reply's text as generated
        self.n = 0  # tokens generated

    def _out(self, text: str, final: bool = False) -> None:
        r, c = self.think.push(text)
        if final:
            r2, c2 = self.think.flush()
            r, c = r + r2, c + c2
        if r or c:
            self.parts["reasoning"].append(r)
            self.parts["content"].append(c)
            self.job.emit("delta", (r, c))

    def push(self, t: int) -> bool:
        """A generated token; True if a stop string ended the reply."""
        self.n += 1
        piece = self.dec.push(t)
        self.raw.append(piece)
        self._out(self.stops.push(piece))
        return self.stops.stopped

    def close(self, finish: str) -> tuple[str, str]:
        """The reply's (reasoning, content), the text held back flushed (unless cancelled)."""
        tail = self.dec.flush()
        self.raw.append(tail)
        if finish != "cancelled":
            self._out(self.stops.push(tail) + self.stops.flush(), final=True)
        return "".join(self.parts["reasoning"]), "".join(self.parts["content"])


@dataclass
class Slot:
    """One sequence the engine can decode: its generator (KV cache, token history, sampler) and, while it serves
    one, the request's job, reply, prompt tokens still to prefill and the logits its next token is sampled from."""

    gen: Generator
    job: Job | None = None
    reply: Reply | None = None
    todo: list = field(default_factory=list)
    logits: np.ndarray | None = None
    keep: int = 0  # prompt tokens reused from the cache
    n_prompt: int = 0
    used_at: float = 0.0  # when its last request ended (a new request takes the least recently used free slot)


class Engine:
    def __init__(self, session, queue_size: int = 8, replies_kept: int = 64, parallel: int = 1):
        self.session, self.tok = session, session.tokenizer
        model = session.model
        self.n_ctx, self.n_vocab = model.n_ctx, session.cfg.n_vocab
        self.ubatch = getattr(model, "ubatch", 512)
        self.slots = [Slot(Generator(model, model.new_state(), Sampler(SamplerParams()))) for _ in range(parallel)]
        self.tok.encode_raw("warm up")  # builds the merge table now, not in two request threads at once
        self.queue_size = queue_size
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.counters = Counters()
        self.batch_size = 0  # sequences in the last decode step
        self.replies: OrderedDict[str, str] = OrderedDict()  # reply content -> the reply as generated
        self.replies_kept = replies_kept
        self._worker = threading.Thread(target=self._run, name="serve-worker", daemon=True)
        self._worker.start()

    @property
    def gen(self) -> Generator:
        """The first slot's generator (the only one with --parallel 1)."""
        return self.slots[0].gen

    # ---- the HTTP side ----
    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull when `queue_size` jobs already wait."""
        with self._cv:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                self.counters.requests["rejected"] += 1
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting)")
            self._queue.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it still waits, else it leaves its slot at the worker's next turn."""
        job.cancel()
        with self._cv:
            try:
                self._queue.remove(job)
                self.counters.requests["cancelled"] += 1
            except ValueError:
                pass
            self._cv.notify()

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        """Slots serving a request."""
        return sum(s.job is not None for s in self.slots)

    def slot_speeds(self) -> list[tuple[int, float]]:
        """(slot index, tokens per second of decoding) of each slot serving a request that has decoded."""
        out = []
        for i, s in enumerate(self.slots):
            st = s.gen.stats
            if s.job is not None and st.gen_s > 0:
                out.append((i, st.gen_tokens / st.gen_s))
        return out

    @property
    def busy(self) -> bool:
        return self.active > 0

    def reply_memory(self) -> dict:
        with self._cv:
            return dict(self.replies)

    def close(self) -> None:
        """Cancel everything, stop the worker, close the session (reader threads joined)."""
        with self._cv:
            self._closed = True
            waiting, self._queue = list(self._queue), deque()
            for s in self.slots:
                if s.job is not None:
                    s.job.cancel()
            self._cv.notify_all()
        for job in waiting:
            job.cancel()
            job.emit("error", APIError(503, "the server is shutting down", "unavailable_error", "shutting_down"))
        self._worker.join(timeout=60)
        self.session.close()

    # ---- the worker ----
    def _run(self) -> None:
        while True:
            if not self.busy:
                self._release_experts()  # idle: no expert slot stays busy between requests
            with self._cv:
                while not self._queue and not self.busy and not self._closed:
                    self._cv.wait()
                if self._closed:
                    self._fail_all(APIError(503, "the server is shutting down", "unavailable_error", "shutting_down"))
                    return
                self._admit()
            try:
                self._turn()
            except Exception:  # never let the worker die: the server would hang with a full queue
                log.error("the worker failed:\n%s", traceback.format_exc())
                self._fail_all(internal_error(), reset=True)

    def _admit(self) -> None:
        """Queued jobs into free slots, in order (called with the lock held)."""
        while self._queue:
            free = [s for s in self.slots if s.job is None]
            if not free:
                return
            job = self._queue.popleft()
            if job.cancelled.is_set():
                self.counters.requests["cancelled"] += 1
                job.emit("done", Result("cancelled", 0, 0, 0, 0.0, 0.0))
                continue
            # the slot whose cache holds most of this prompt; among equals the least recently used
            slot = max(free, key=lambda s: (self.plan(job.req, s.gen)[0], -s.used_at))
            self._start(slot, job)

    def _start(self, slot: Slot, job: Job) -> None:
        """Set a slot up for a job: keep the cached prefix, the request's sampler and stops; or answer at once
        with an error (a prompt longer than the context)."""
        req, gen = job.req, slot.gen
        keep, new = self.plan(req, gen)
        if keep + len(new) > self.n_ctx:
            self.counters.requests["error"] += 1
            job.emit(
                "error",
                APIError(
                    400,
                    f"the prompt has {keep + len(new)} tokens, more than the context size {self.n_ctx}",
                    "invalid_request_error",
                    "context_length_exceeded",
                ),
            )
            return
        gen.state.truncate(keep)
        del gen.history[keep:]
        gen.pending = None
        gen.sampler = Sampler(req.params)
        gen.stop_ids = frozenset() if req.ignore_eos else self.tok.eog_ids
        gen.stats = type(gen.stats)()
        slot.job, slot.reply, slot.todo, slot.logits = job, Reply(job, self.tok), list(new), None
        slot.keep, slot.n_prompt = keep, keep + len(new)

    def _turn(self) -> None:
        """One turn: cancelled requests leave, every decoding request samples a token, and one forward runs the
        pending tokens of those still going together with a prompt chunk of each request being prefilled."""
        for s in self.slots:
            if s.job is not None and s.job.cancelled.is_set():
                self._finish(s, "cancelled")
        going = [s for s in self.slots if s.job is not None and s.logits is not None and self._next_token(s)]
        filling = [s for s in self.slots if s.job is not None and s.todo]
        self.batch_size = len(going)
        # the prompt tokens this forward takes: a whole Model.ubatch when nobody decodes, else BUSY_CHUNK (each
        # decoding request's next token waits for them), shared among the prompts being prefilled
        room = (self.ubatch if not going else min(self.ubatch, BUSY_CHUNK)) - len(going)
        chunks = []
        for i, s in enumerate(filling):
            size = max(1, room // (len(filling) - i))
            chunks.append(s.todo[:size])
            room -= len(chunks[-1])
        run = going + filling
        if not run:
            return
        try:
            logits = feed_together([s.gen for s in run], [[s.gen.pending] for s in going] + chunks)
        except Exception as e:  # noqa: BLE001 - each request of the forward gets the error
            for s in run:
                self._fail(s, e)
            return
        for s, c in zip(filling, chunks):
            del s.todo[: len(c)]
        for s, row in zip(run, logits):
            if not s.todo:  # a prompt's last chunk, or a decoded token: the next token is sampled from these
                s.logits = row

    def _next_token(self, s: Slot) -> bool:
        """Sample the slot's next token and send it; True if the request goes on (its token is then pending,
        to be decoded by the next step), else the slot is finished."""
        gen, r = s.gen, s.reply
        logits, s.logits = s.logits, None
        max_tokens = s.job.req.max_tokens
        if 0 <= max_tokens <= r.n:
            self._finish(s, "length")
            return False
        tok = gen.pick(logits)
        if tok is None:
            self._finish(s, "stop")
            return False
        if r.push(tok):
            self._finish(s, "stop")
            return False
        if s.job.cancelled.is_set():
            self._finish(s, "cancelled")
            return False
        if gen.state.room() == 0 or 0 <= max_tokens <= r.n:
            self._finish(s, "length")
            return False
        return True

    def _finish(self, s: Slot, finish: str) -> None:
        """The slot's request is done: send its result, count it, free the slot."""
        job, r, gen = s.job, s.reply, s.gen
        reasoning, content = r.close(finish)
        req = job.req
        if req.text is not None and finish != "cancelled" and not r.stops.stopped:
            self._remember(content, req.head + "".join(r.raw))
        res = Result(finish, s.n_prompt, s.keep, r.n, gen.stats.prompt_s, gen.stats.gen_s, reasoning, content)
        c = self.counters
        c.requests["cancelled" if finish == "cancelled" else "ok"] += 1
        c.prompt_tokens += res.prefilled
        c.cached_tokens += res.cached_tokens
        c.completion_tokens += res.completion_tokens
        c.prompt_s += res.prompt_s
        c.gen_s += res.gen_s
        if res.prompt_s > 0 and res.prefilled:
            c.last_prompt_tps = res.prefilled / res.prompt_s
        if res.gen_s > 0 and res.completion_tokens > 1:
            c.last_gen_tps = (res.completion_tokens - 1) / res.gen_s
        self._free(s)
        job.emit("done", res)

    def _fail(self, s: Slot, e: BaseException) -> None:
        """The slot's request failed: its error to the client, the slot freed (its cache emptied after a bug)."""
        if isinstance(e, ModelFileChanged):  # the weights are gone: every request will fail, say why
            err = APIError(500, str(e), "server_error", "model_file_changed")
        elif isinstance(e, StreamerError):  # e.g. context overflow: a client error, the engine carries on
            err = APIError(400, str(e), "invalid_request_error", "invalid_request")
        elif isinstance(e, APIError):
            err = e
        else:  # a bug: log it, start this slot's next request from an empty cache
            log.error("generation failed:\n%s", "".join(traceback.format_exception(e)))
            err = internal_error()
            s.gen.reset()
        self.counters.requests["error"] += 1
        job = s.job
        self._free(s)
        job.emit("error", err)

    def _fail_all(self, err: APIError, reset: bool = False) -> None:
        for s in self.slots:
            if s.job is not None:
                if reset:
                    s.gen.reset()
                self.counters.requests["error"] += 1
                job = s.job
                self._free(s)
                job.emit("error", err)

    def _free(self, s: Slot) -> None:
        with self._cv:
            s.job, s.reply, s.todo, s.logits = None, None, [], None
            s.used_at = time.monotonic()

    def _release_experts(self) -> None:
        """Let prefetches in flight land, so no expert slot is busy between requests."""
        if self.session.moe is not None:
            self.session.moe.source.drain()

    def plan(self, req: GenRequest, gen: Generator) -> tuple[int, list[int]]:
        """(tokens of gen's cache to keep, tokens to prefill after them). Chat prompts are matched as text
        first: the cache holds earlier replies as the tokens we sampled, which re-encoding their text need not
        reproduce. Otherwise (or when the text differs, or the cache ends inside a character, which then
        decodes to U+FFFD) the longest common token prefix is kept. At least one token is always prefilled
        (its logits start the reply)."""
        hist = gen.history
        if not req.cache_prompt:
            return 0, list(req.ids)
        if req.text is not None and hist:
            # as text, with invalid bytes as U+FFFD: a reply that sampled a stray byte comes back from the
            # client as the U+FFFD it was shown, and is then matched to the bytes we generated
            cached = b"".join(self.tok.token_bytes(t) for t in hist).decode("utf-8", "replace")
            if len(req.text) > len(cached) and req.text.startswith(cached):
                return len(hist), self.tok.encode_raw(req.text[len(cached) :])
        ids = list(req.ids)
        keep = gen.state.restorable(min(common_prefix(hist, ids), len(ids) - 1))  # a recurrent state: saved points
        return keep, ids[keep:]

    def _remember(self, content: str, body: str) -> None:
        if content != body:
            with self._cv:
                self.replies[content] = body
                self.replies.move_to_end(content)
                while len(self.replies) > self.replies_kept:
                    self.replies.popitem(last=False)


def internal_error() -> APIError:
    return APIError(500, "internal error while generating (see the server log)", "server_error", "internal_error")
