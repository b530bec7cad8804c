"""The generation engine: one model, one KV cache, one worker thread running one generation at a time from a
bounded FIFO queue. The KV cache is kept between requests: a prompt that starts with what the cache holds
(the usual multi-turn chat) prefills only the rest, as llama-server's cache_prompt.

Jobs talk to the HTTP side through a callback (`emit(kind, payload)`), called from the worker thread:
("delta", (reasoning, content)) pieces, then exactly one ("done", Result) or ("error", APIError). A job can be
cancelled at any time (client gone): the worker stops at the next token (or the next prefill chunk) and the
MoE layer has already released every expert it held (it does so after each step)."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from streamer.errors import ModelFileChanged, StreamerError
from streamer.generate import Generator
from streamer.sampler import Sampler, SamplerParams
from streamer.server.schemas import APIError, GenRequest
from streamer.server.text import StopMatcher, ThinkSplitter

log = logging.getLogger(__name__)


class Cancelled(Exception):
    pass


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


class Engine:
    def __init__(self, session, queue_size: int = 8, replies_kept: int = 64):
        self.session, self.tok = session, session.tokenizer
        model = session.model
        self.n_ctx, self.n_vocab = model.n_ctx, session.cfg.n_vocab
        self.gen = Generator(model, model.new_state(), Sampler(SamplerParams()), self.tok.eog_ids)
        self.gen.on_prefill = self._prefill_progress
        self.tok.encode_raw("warm up")  # builds the merge table now, not in two request threads at once
        self.queue_size = queue_size
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._current: Job | None = None
        self._closed = False
        self.counters = Counters()
        self.replies: OrderedDict[str, str] = OrderedDict()  # reply content -> the reply as generated
        self.replies_kept = replies_kept
        self._worker = threading.Thread(target=self._run, name="serve-worker", daemon=True)
        self._worker.start()

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
        """The client is gone: drop the job if it still waits, else stop it at its next token."""
        job.cancel()
        with self._cv:
            try:
                self._queue.remove(job)
                self.counters.requests["cancelled"] += 1
            except ValueError:
                pass

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._current is not None

    def reply_memory(self) -> dict:
        with self._cv:
            return dict(self.replies)

    def close(self) -> None:
        """Cancel everything, stop the worker, close the session (reader threads joined)."""
        with self._cv:
            self._closed = True
            waiting, self._queue = list(self._queue), deque()
            if self._current is not None:
                self._current.cancel()
            self._cv.notify_all()
        for job in waiting:
            job.cancel()
            job.emit("error", APIError(503, "the server is shutting down", "unavailable_error", "shutting_down"))
        self._worker.join(timeout=60)
        self.session.close()

    # ---- the worker ----
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._current = self._queue.popleft()
            try:
                self._serve(job)
            except Exception:  # never let the worker die: the server would hang with a full queue
                log.error("the worker failed:\n%s", traceback.format_exc())
            finally:
                with self._cv:
                    self._current = None

    def _prefill_progress(self, done: int, total: int) -> None:
        job = self._current
        if job is not None and job.cancelled.is_set():
            raise Cancelled  # Generator rolls the cache back to where this prefill started

    def _serve(self, job: Job) -> None:
        c = self.counters
        try:
            res = self._generate(job)
        except APIError as e:
            c.requests["error"] += 1
            job.emit("error", e)
            return
        except ModelFileChanged as e:  # the weights are gone: every request will fail, say why
            c.requests["error"] += 1
            job.emit("error", APIError(500, str(e), "server_error", "model_file_changed"))
            return
        except StreamerError as e:  # e.g. context overflow: a client error, the engine carries on
            c.requests["error"] += 1
            job.emit("error", APIError(400, str(e), "invalid_request_error", "invalid_request"))
            return
        except Exception:  # a bug: log it, start the next request from an empty cache
            log.error("generation failed:\n%s", traceback.format_exc())
            self.gen.reset()
            c.requests["error"] += 1
            job.emit(
                "error",
                APIError(500, "internal error while generating (see the server log)", "server_error", "internal_error"),
            )
            return
        finally:
            self._release_experts()
        c.requests["cancelled" if res.finish_reason == "cancelled" else "ok"] += 1
        c.prompt_tokens += res.prefilled
        c.cached_tokens += res.cached_tokens
        c.completion_tokens += res.completion_tokens
        c.prompt_s += res.prompt_s
        c.gen_s += res.gen_s
        if res.prompt_s > 0 and res.prefilled:
            c.last_prompt_tps = res.prefilled / res.prompt_s
        if res.gen_s > 0 and res.completion_tokens > 1:
            c.last_gen_tps = (res.completion_tokens - 1) / res.gen_s
        job.emit("done", res)

    def _release_experts(self) -> None:
        """Let prefetches in flight land, so no expert slot is busy between requests."""
        if self.session.moe is not None:
            self.session.moe.source.drain()

    def plan(self, req: GenRequest) -> tuple[int, list[int]]:
        """(tokens of the cache to keep, tokens to prefill after them). Chat prompts are matched as text
        first: the cache holds earlier replies as the tokens we sampled, which re-encoding their text need not
        reproduce. Otherwise (or when the text differs, or the cache ends inside a character, which then
        decodes to U+FFFD) the longest common token prefix is kept. At least one token is always prefilled
        (its logits start the reply)."""
        hist = self.gen.history
        if not req.cache_prompt:
            return 0, list(req.ids)
        if req.text is not None and hist:
            # as text, with invalid bytes as U+FFFD: a reply that sampled a stray byte comes back from the
            # client as the U+FFFD it was shown, and is then matched to the bytes we generated
            cached = b"".join(self.tok.token_bytes(t) for t in hist).decode("utf-8", "replace")
            if len(req.text) > len(cached) and req.text.startswith(cached):
                return len(hist), self.tok.encode_raw(req.text[len(cached) :])
        ids = list(req.ids)
        keep = self.gen.state.restorable(min(common_prefix(hist, ids), len(ids) - 1))  # a recurrent state: saved points
        return keep, ids[keep:]

    def _generate(self, job: Job) -> Result:
        req, gen = job.req, self.gen
        if job.cancelled.is_set():
            return Result("cancelled", 0, 0, 0, 0.0, 0.0)
        keep, new = self.plan(req)
        if keep + len(new) > self.n_ctx:
            raise APIError(
                400,
                f"the prompt has {keep + len(new)} tokens, more than the context size {self.n_ctx}",
                "invalid_request_error",
                "context_length_exceeded",
            )
        gen.state.truncate(keep)
        del gen.history[keep:]
        gen.pending = None
        gen.sampler = Sampler(req.params)
        gen.stop_ids = frozenset() if req.ignore_eos else self.tok.eog_ids
        gen.stats = type(gen.stats)()
        dec, stops, think = self.tok.stream_decoder(), StopMatcher(req.stops), ThinkSplitter(req.think)
        parts = {"reasoning": [], "content": []}
        raw = []  # the reply's text as generated (for the replies memory)

        def out(text: str, final: bool = False) -> None:
            r, c = think.push(text)
            if final:
                r2, c2 = think.flush()
                r, c = r + r2, c + c2
            if r or c:
                parts["reasoning"].append(r)
                parts["content"].append(c)
                job.emit("delta", (r, c))

        n, finish = 0, None
        try:
            for t in gen.generate(new, req.max_tokens):
                n += 1
                piece = dec.push(t)
                raw.append(piece)
                out(stops.push(piece))
                if stops.stopped:
                    finish = "stop"
                    break
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
        except Cancelled:
            finish = "cancelled"
        if finish is None:
            finish = "stop" if gen.stop_reason == "eog" else "length"
        tail = dec.flush()
        raw.append(tail)
        if finish != "cancelled":
            out(stops.push(tail) + stops.flush(), final=True)
        reasoning, content = "".join(parts["reasoning"]), "".join(parts["content"])
        if req.text is not None and finish != "cancelled" and not stops.stopped:
            self._remember(content, req.head + "".join(raw))
        return Result(finish, keep + len(new), keep, n, gen.stats.prompt_s, gen.stats.gen_s, reasoning, content)

    def _remember(self, content: str, body: str) -> None:
        if content != body:
            with self._cv:
                self.replies[content] = body
                self.replies.move_to_end(content)
                while len(self.replies) > self.replies_kept:
                    self.replies.popitem(last=False)
