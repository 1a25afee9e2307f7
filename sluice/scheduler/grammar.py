"""Grammar-constrained decoding with llguidance: compile off the loop, queue, match.

A request that carries a grammar (`json_schema`, `regex` or `ebnf` in its sampling params) gets a
`GrammarMatcher` of its own before it may be scheduled:

- compilation runs on a thread pool, never on the scheduler loop; its result is cached by
  (kind, text), so the same grammar compiles once and a grammar that failed fails fast;
- a request whose grammar is not compiled yet waits in this manager's queue, apart from the
  waiting queue: it blocks nobody, and `poll` moves it on when its grammar is ready;
- compiling is bounded in time: a grammar whose own compilation runs past `timeout` seconds ends
  its requests with a 400 and is remembered as failed (a grammar engine cannot be interrupted;
  the thread finishes on its own and its result is dropped); time spent waiting for a free
  thread does not count, and a compilation nobody waits for any more is cancelled if it has
  not started;
- a plain greedy row (`batch.checks_first`: no penalties, logit bias or blocked stops, no
  forced bytes next) needs no mask when its grammar allows its raw argmax (`allows`), which is
  then the masked argmax too; only a refused row gets its mask, after the forward
  (`check_first`; off, every constrained row gets one);
- `fill_masks` writes the allowed-token bitmasks of the other constrained rows of a step, one
  matcher after the other on its thread (llguidance's executor added threads that spun beside
  the forward's: benchmarks/README.md, `structured_output.py`); the sampler reads
  them as bitmasks over the batch's logits (`model/sampler.py`, with the CPU kernels'
  `masked_argmax` for greedy rows). `start_masks` runs it on a thread of its own while the
  forward runs (both release the GIL): the step joins it before sampling, and before anything
  advances a matcher again, so a matcher is never read and advanced at once.

The matcher advances with each accepted token; when the grammar can take no further token it is
stopped, and the request ends with "stop". An `ebnf` grammar is Lark (llguidance's dialect, which
also embeds JSON schemas with `%json`) or GBNF (llama.cpp's), told apart by llguidance.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from sluice.aborts import internal_error
from sluice.messages import FinishReason

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # the SamplingParams fields that carry one
CACHE_SIZE = 256  # compiled grammars (and failures) kept, least recently used dropped first
BITS = 32  # tokens per int32 word of a bitmask
# JSON output may be laid out freely, but a run of whitespace is bounded: a model that keeps
# picking spaces or newlines (small models do) cannot fill its whole budget with them. A schema
# may override it in "x-guidance" (llguidance's JsonCompileOptions).
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,24}"}


def grammar_key(params: Any) -> tuple[str, str] | None:
    """(kind, text) of the grammar a request's sampling params ask for, or None."""
    for kind in GRAMMAR_KINDS:
        text = getattr(params, kind, None)
        if text is not None:
            return kind, text
    return None


@dataclass
class _Job:
    """One compilation: its future, and when the pool thread began it (None: not yet)."""

    future: Future[Compiled]
    started: float | None = None


@dataclass
class Compiled:
    """A compiled grammar: a matcher at its start state to copy, or why it failed."""

    matcher: Any | None  # llguidance.LLMatcher
    error: str | None = None


class GrammarMatcher:
    """One request's grammar state: what it allows next, advanced token by token."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token: int) -> str | None:
        """Advance by a sampled token; None, or what went wrong (the mask forbade it)."""
        if self._m.consume_token(token) and not self._m.is_error():
            return None
        return self._m.get_error() or f"token {token} is not allowed by the grammar"

    def allows(self, token: int) -> bool:
        """Whether `token` may come next (the state is not changed). Where no bytes are forced
        this is what the mask says of it; where some are, the mask is narrower (llguidance
        allows only the forced bytes' canonical tokens there), so ask the mask."""
        try:
            return self._m.validate_tokens([token]) == 1
        except (ValueError, OverflowError):  # an id the tokenizer does not have
            return False

    @property
    def has_forced_bytes(self) -> bool:
        """The grammar allows one continuation only for the next bytes (e.g. a key's rest)."""
        return bool(self._m.compute_ff_bytes())

    @property
    def is_terminated(self) -> bool:
        """The grammar takes no further token (it matched in full and cannot go on)."""
        return self._m.is_stopped()


class GrammarManager:
    """Owns compilation, the compiled-grammar cache and the queue of requests waiting for one.

    `tokenizer` is the model's Hugging Face (fast) tokenizer; `vocab_size` the width of the
    model's logits, which may exceed the tokenizer's vocabulary (padding rows stay disallowed).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        timeout: float,
        num_threads: int = 2,
        overlap: bool = True,
        check_first: bool = True,
    ) -> None:
        self.hf_tokenizer, self.vocab_size, self.timeout = tokenizer, vocab_size, timeout
        # the CPUs of the pools' threads (`--cpu-bind`: off the scheduler's Python thread's);
        # None: their creator's
        self.thread_cpus: frozenset[int] | None = None
        self.pool = ThreadPoolExecutor(
            num_threads, thread_name_prefix="grammar", initializer=self._place_thread
        )
        # masks are filled beside the forward (`overlap`), one step at a time
        self.overlap = overlap
        # plain greedy requests fill a mask only when their grammar refuses their token
        self.check_first = check_first
        self.mask_pool = ThreadPoolExecutor(
            1, thread_name_prefix="grammar-mask", initializer=self._place_thread
        )
        self.cache: OrderedDict[tuple[str, str], _Job] = OrderedDict()
        self.queue: list[tuple[Any, tuple[str, str], _Job]] = []  # (req, key, its compilation)
        self._lltok: Any = None
        self._lltok_lock = threading.Lock()
        self.num_words = (vocab_size + BITS - 1) // BITS
        # llguidance's tokenizer takes about half a second to build, holding the GIL: at
        # start-up, off the loop, rather than when the first grammar arrives
        threading.Thread(target=self._tokenizer, name="grammar-tokenizer", daemon=True).start()

    def _place_thread(self) -> None:
        """The start of each pool thread (made on first use, after any pinning)."""
        if self.thread_cpus is not None:
            os.sched_setaffinity(0, self.thread_cpus)

    # ---- compilation --------------------------------------------------------------------

    def compile(self, key: tuple[str, str]) -> _Job:
        """The cached compilation of `key`, started now when it is not cached."""
        job = self.cache.get(key)
        if job is None:
            job = _Job(Future())
            job.future = self.pool.submit(self._compile, key, job)
            self.cache[key] = job
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        return job

    def _compile(self, key: tuple[str, str], job: _Job) -> Compiled:
        """Runs on the pool. Grammar errors are results, never exceptions."""
        import llguidance

        job.started = time.monotonic()
        kind, text = key
        start = time.perf_counter()
        try:
            tok = self._tokenizer()
            grammar = _llguidance_grammar(kind, text)
            error = llguidance.LLMatcher.validate_grammar(grammar, tok)
            if error:
                return Compiled(None, _grammar_error(kind, error))
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
            if not matcher.is_error():
                matcher.compute_bitmask()  # the lazy part of the build, here rather than in a step
            if matcher.is_error():
                return Compiled(None, _grammar_error(kind, matcher.get_error()))
        except Exception as e:  # llguidance raises ValueError on some inputs; all are the grammar's
            return Compiled(None, _grammar_error(kind, f"{type(e).__name__}: {e}"))
        logger.debug("compiled a %s grammar in %.1f ms", kind, 1e3 * (time.perf_counter() - start))
        return Compiled(matcher)

    def _tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once (about half a second): by a thread
        started with the manager, or by the first compilation if that comes first."""
        with self._lltok_lock:
            if self._lltok is None:
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size
                )
            return self._lltok

    def fail(self, key: tuple[str, str], error: str) -> None:
        """Remember `key` as failed, so the next request with it fails at once."""
        done: Future[Compiled] = Future()
        done.set_result(Compiled(None, error))
        self.cache[key] = _Job(done, time.monotonic())

    # ---- the queue ----------------------------------------------------------------------

    def add(self, req: Any, key: tuple[str, str]) -> str | None:
        """Give `req` its matcher now when its grammar is compiled (None: ready), else queue
        it ("queued"); or the error of a grammar known to fail."""
        job = self.compile(key)
        if not job.future.done():
            self.queue.append((req, key, job))
            return "queued"
        return self._attach(req, job.future.result())

    def poll(self, now: float) -> tuple[list[Any], list[tuple[Any, str]]]:
        """The queued requests whose grammar is now ready (matcher attached), and those whose
        grammar failed or timed out, with the error; both leave the queue."""
        ready: list[Any] = []
        failed: list[tuple[Any, str]] = []
        still = []
        for req, key, job in self.queue:
            if job.future.done():
                error = self._attach(req, job.future.result())
            elif job.started is not None and now - job.started > self.timeout:
                error = f"compiling the grammar took longer than {self.timeout:g} s"
                if self.cache.get(key) is job:
                    self.fail(key, error)
            else:
                still.append((req, key, job))
                continue
            (ready.append(req) if error is None else failed.append((req, error)))
        self.queue = still
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for one queued compilation to finish (when nothing
        else can run)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        if self.queue:
            wait_futures({job.future for *_, job in self.queue}, timeout, FIRST_COMPLETED)

    def discard(self, reqs: set[int]) -> None:
        """Drop queued requests (by id()) that are being aborted; a compilation none of the
        remaining ones waits for is cancelled when it has not started (and then uncached)."""
        dropped = [entry for entry in self.queue if id(entry[0]) in reqs]
        if not dropped:
            return
        self.queue = [entry for entry in self.queue if id(entry[0]) not in reqs]
        waited = {id(job) for *_, job in self.queue}
        for _, key, job in dropped:
            if id(job) not in waited and job.future.cancel() and self.cache.get(key) is job:
                del self.cache[key]

    def __len__(self) -> int:
        return len(self.queue)

    def _attach(self, req: Any, compiled: Compiled) -> str | None:
        if compiled.matcher is None:
            return compiled.error
        req.grammar = GrammarMatcher(compiled.matcher.deep_copy())
        return None

    # ---- masks --------------------------------------------------------------------------

    def start_masks(self, reqs: list[Any]) -> Future[torch.Tensor]:
        """`fill_masks(reqs)`, on the mask thread (or done now without `overlap`). The caller
        waits for it before any of `reqs` advances its grammar."""
        if self.overlap:
            return self.mask_pool.submit(self.fill_masks, reqs)
        done: Future[torch.Tensor] = Future()
        try:
            done.set_result(self.fill_masks(reqs))
        except Exception as e:
            done.set_exception(e)
        return done

    def fill_masks(self, reqs: list[Any]) -> torch.Tensor:
        """The allowed-token bitmask [G, ceil(V / 32)] int32 of each request's next token: its
        grammar's, plus the opening token of an optional reasoning on its first token. On the
        calling thread, one matcher after the other (each call drops the GIL): beside the
        forward, which has the cores, or after it for a few rows; llguidance's executor would
        add threads that spin beside the forward's."""
        masks = torch.empty((len(reqs), self.num_words), dtype=torch.int32)
        for i, req in enumerate(reqs):
            req.grammar._m.unsafe_compute_mask_ptr(masks[i].data_ptr(), self.num_words * 4)
        for i, req in enumerate(reqs):
            if req.reasoning_start_id >= 0:
                word, bit = divmod(req.reasoning_start_id, BITS)
                masks[i, word] |= (1 << bit) - (1 << BITS if bit == BITS - 1 else 0)
        return masks


def _llguidance_grammar(kind: str, text: str) -> str:
    import llguidance

    if kind == "json_schema":
        json.loads(text)  # a JSONDecodeError (a ValueError) names the position
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.grammar_from("ebnf", text)


def _grammar_error(kind: str, error: str) -> str:
    error = " ".join(error.split())
    return f"the {kind} grammar could not be compiled: {error[:500]}"


def advance_grammar(
    req: Any, token: int, reason: FinishReason | None, eos_ids: frozenset[int]
) -> FinishReason | None:
    """A constrained request's grammar phase after `token` (it may change the finish reason):
    an optional reasoning opens or is skipped (first token), the reasoning ends, or the grammar
    consumes the token. A grammar that takes nothing more ends the request with "stop" (an EOS
    that ended it is the stop matched, so it is trimmed from the text even with ignore_eos);
    a token the grammar refuses is a 500."""
    if req.reasoning_start_id >= 0:
        opened = token == req.reasoning_start_id
        req.reasoning_start_id = -1
        if opened:
            return reason
        req.grammar_after_id = -1  # no reasoning: this token is the grammar's first
    if req.grammar_after_id >= 0:
        if token == req.grammar_after_id:  # the reasoning ended: the grammar starts now
            req.grammar_after_id = -1
        return reason
    error = req.grammar.accept(token)
    if error is not None:
        return internal_error(f"the sampled token broke the grammar: {error}")
    if reason is None and req.grammar.is_terminated:
        return FinishReason(type="stop", matched=token if token in eos_ids else None)
    return reason
