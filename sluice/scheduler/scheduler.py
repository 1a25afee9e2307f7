"""Scheduler: continuous batching over a paged KV cache with a radix prefix cache.

One `step()`: expire deadlines, process aborts → pick the next batch (a prefill if anything can be
admitted, with the running batch decoding in the same forward; else one decode step of the running
batch) → run it → process the results → emit outputs.

Pooled requests (embeddings, label-token scores; `add_embedding_request`) are prefill-only
`Req`s on the same path (queue, prefix cache, chunking, abort, timeouts, `_release`); they never
decode. `step()` returns the generation requests' BatchTokenIDOutput; the pooled requests that
finished wait in `pooled_done` for `take_embedding_output()`, called after each step.

Ownership: the scheduler owns every `Req` from intake to finish. A finished or aborted request
goes through `_release` exactly once, which hands its KV to the radix cache (or frees it), drops
its lock and its request row. At idle, every KV slot is free or held by the cache
(`check_idle_invariant`).
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from sluice.aborts import abort, aborted, internal_error, invalid, shutdown
from sluice.checkpoint.model_config import ModelConfig
from sluice.checkpoint.vision import ImageSlots
from sluice.config import ServerArgs
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    CloseSessionReq,
    FinishReason,
    InternalState,
    OpenSessionReply,
    OpenSessionReq,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from sluice.model.runner import ModelRunner
from sluice.scheduler.batch import (
    StepOutput,
    StepPlan,
    checks_first,
    constrained_reqs,
    execute,
    plan_decode,
    plan_prefill,
)
from sluice.scheduler.finish import FinishChecker
from sluice.scheduler.grammar import GrammarManager, advance_grammar, grammar_key
from sluice.scheduler.images import image_spans
from sluice.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sluice.scheduler.output import build_embedding_output, build_output
from sluice.scheduler.prefill_adder import AddResult, PrefillAdder, sort_waiting
from sluice.scheduler.radix_cache import RadixCache
from sluice.scheduler.req import EMBED, SCORE, Req
from sluice.scheduler.resources import Resources
from sluice.scheduler.sessions import SessionError, SessionManager, TurnPlan, prepended_bos
from sluice.scheduler.timeouts import DeadlineTracker

logger = logging.getLogger(__name__)

NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.001
RETRACT_HEADROOM_STEPS = 16  # decode steps of room to make when retracting
GRAMMAR_WAIT_S = 0.005  # how long an otherwise idle step waits for a compilation
# a mixed step that SDPA takes builds padded [B, max_q, max_kv] attention metadata: at most this
# many entries
MIX_MAX_PADDED = 1 << 24


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        cfg: ModelConfig,
        tokenizer: Any,
        res: Resources,
        runner: ModelRunner | None = None,
    ) -> None:
        """`runner`: the model (default: loaded from `cfg` as `res` says)."""
        self.args, self.cfg, self.res = args, cfg, res
        self.context_len = res.context_len
        self.runner = runner or ModelRunner(
            cfg, res.device, res.dtype, res.max_total_tokens, res.quantization,
            image_cache_bytes=args.image_feature_cache_mb * 1024 * 1024,
        )  # fmt: skip
        self.allocator = TokenToKVPoolAllocator(res.max_total_tokens)
        self.req_pool = ReqToTokenPool(res.max_running_requests, self.context_len + 1)
        self.tree = RadixCache(self.allocator, disable=args.disable_radix_cache)
        self.finish_checker = FinishChecker(tokenizer, self.context_len)
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self.image_slots = ImageSlots.of(cfg)  # None: text only
        self.rng = random.Random(args.random_seed)
        self.sessions = SessionManager(prepended_bos(tokenizer))
        self.grammars = (
            None
            if args.grammar_backend == "none"
            else GrammarManager(tokenizer, cfg.vocab_size, args.grammar_compile_timeout)
        )

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.reqs: dict[str, Req] = {}  # every live request by rid
        self.touched: list[Req] = []  # requests with something to report after this step
        self.pooled_done: list[Req] = []  # finished pooled requests not yet reported
        self.aborting: list[Req] = []  # live requests whose `to_abort` was set, not yet ended
        self.deadlines = DeadlineTracker(args.waiting_timeout, args.running_timeout)
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self.last_heartbeat = time.monotonic()
        self.num_forward_steps = 0
        self.num_retractions = 0
        self.paused = False  # set_paused: no forward step while set

    # ---- intake -------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        """Take a request in (a session turn's prompt is built from its session first), or
        end it at once with a 400 abort."""
        plan: TurnPlan | None = None
        if msg.session_params is not None:
            try:
                plan = self.sessions.plan(msg.session_params, msg.rid, msg.input_ids)
            except SessionError as e:
                return self._reject(self._build_req(msg, msg.input_ids), e.message, e.code)
        req = self._build_req(msg, plan.input_ids if plan is not None else msg.input_ids)
        error = self._attach_images(req, msg) if msg.images else None
        error = error or self._validate(req)
        if msg.rid in self.reqs:
            error = f"a request with rid {msg.rid!r} is already running"
        if error is not None:
            return self._reject(req, error, "invalid_request")
        grammar = self._grammar_status(req)
        if grammar not in (None, "queued"):
            return self._reject(req, grammar, "invalid_grammar")
        if grammar == "queued":  # the turn starts (and replaces) once its grammar compiled
            req.pending_turn = plan
        elif plan is not None:
            self._start_turn(req, plan)
        self._enqueue(req, queued=grammar == "queued")

    def _start_turn(self, req: Req, plan: TurnPlan) -> None:
        replaced = abort(
            409, "session_replaced", "a later turn of the session replaced this request"
        )
        for victim in self.sessions.start(plan, req, req.arrival_time):
            self._mark_abort(victim, replaced)

    def add_embedding_request(self, msg: TokenizedEmbeddingReqInput) -> None:
        """Take a prefill-only request in: an embedding (no `label_token_ids`) or label-token
        logprobs; or end it at once with a 400 abort. `token_type_ids` mean nothing to a
        decoder and are ignored."""
        pooled = EMBED if msg.label_token_ids is None else SCORE
        req = Req(
            msg.rid, list(msg.input_ids), SamplingParams(max_new_tokens=0), 0, frozenset(),
            reply_to=msg.reply_to, pooled=pooled, label_token_ids=msg.label_token_ids,
        )  # fmt: skip
        error = self._validate(req)
        if msg.rid in self.reqs:
            error = f"a request with rid {msg.rid!r} is already running"
        if error is not None:
            return self._reject(req, error, "invalid_request")
        self._enqueue(req)

    def _enqueue(self, req: Req, queued: bool = False) -> None:
        """Register a live request: in the waiting queue, or (`queued`) in the grammar queue."""
        self.reqs[req.rid] = req
        if not queued:
            self.waiting.append(req)
        self.deadlines.add(req, req.arrival_time)

    def _grammar_status(self, req: Req) -> str | None:
        """None: no grammar, or its matcher is attached; "queued": compiling; else the error."""
        key = grammar_key(req.params)
        if key is None:
            return None
        if self.grammars is None:
            return f"{key[0]} needs a grammar backend; this server runs with --grammar-backend none"
        return self.grammars.add(req, key)

    def _poll_grammars(self, now: float) -> None:
        """Requests whose grammar compiled join the waiting queue; failed ones end with 400."""
        if not self.grammars:
            return
        ready, failed = self.grammars.poll(now)
        for req in ready:
            if req.pending_turn is not None:
                self._start_turn(req, req.pending_turn)
                req.pending_turn = None
        self.waiting.extend(ready)
        for req, error in failed:
            self.touched.append(req)
            self.finish(req, invalid(error, "invalid_grammar"))

    def _reject(self, req: Req, message: str, code: str) -> None:
        req.finished_reason = invalid(message, code)
        self.touched.append(req)

    def _build_req(self, msg: TokenizedGenerateReqInput, input_ids: list[int]) -> Req:
        p = msg.sampling_params
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        if p.max_new_tokens is None:
            limit = min(self.context_len, self.allocator.size)
            p.max_new_tokens = max(limit - len(input_ids), 0)
        return Req(
            msg.rid, list(input_ids), p, seed, stop_ids,
            return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num, stream=msg.stream, reply_to=msg.reply_to,
            timeout=msg.timeout, grammar_after_id=msg.grammar_after_id,
            reasoning_start_id=msg.reasoning_start_id,
        )  # fmt: skip

    def _attach_images(self, req: Req, msg: TokenizedGenerateReqInput) -> str | None:
        """Give `req` the message's images (scheduler/images.py); the refusal, or None."""
        if msg.session_params is not None:
            return "images in session turns are not supported"
        try:
            req.images = image_spans(
                msg.images, req.origin_input_ids, self.image_slots, self.cfg.vocab_size
            )
        except ValueError as e:
            return str(e)
        return None

    def _validate(self, req: Req) -> str | None:
        """A request's images were checked with their ids (`_attach_images`)."""
        n = len(req.origin_input_ids)
        if n == 0:
            return "the prompt is empty"
        ids = req.origin_input_ids
        if not req.images and (min(ids) < 0 or max(ids) >= self.cfg.vocab_size):
            return f"token ids must be in [0, {self.cfg.vocab_size})"
        labels = req.label_token_ids
        if labels is not None and not labels:
            return "label_token_ids is empty"
        if labels and (min(labels) < 0 or max(labels) >= self.cfg.vocab_size):
            return f"label token ids must be in [0, {self.cfg.vocab_size})"
        if n + req.max_new_tokens > self.context_len:
            return (
                f"this model's maximum context length is {self.context_len} tokens; the request "
                f"has {n} prompt tokens plus {req.max_new_tokens} max new tokens"
            )
        if n + req.max_new_tokens > self.allocator.size:
            return (
                f"the request needs {n + req.max_new_tokens} KV slots but the KV pool holds "
                f"{self.allocator.size} (raise --max-total-tokens)"
            )
        return None

    def abort(self, msg: AbortReq) -> None:
        """Mark the request(s) of the aborting worker (`msg.reply_to`; empty: any) for the abort
        finish at the start of the next step; an unknown or finished rid is ignored (it raced
        with its own finish)."""
        reason = _abort_reason(msg.reason)
        rids = list(self.reqs) if msg.abort_all else [msg.rid]
        for rid in rids:
            req = self.reqs.get(rid)
            if req is not None and msg.reply_to in ("", req.reply_to):
                self._mark_abort(req, reason)

    def _mark_abort(self, req: Req, reason: FinishReason) -> None:
        if req.to_abort is None:
            req.to_abort = reason
            self.aborting.append(req)

    # ---- sessions -----------------------------------------------------------------------

    def open_session(self, msg: OpenSessionReq) -> OpenSessionReply:
        error = self.sessions.open(msg, time.monotonic())
        return OpenSessionReply(msg.session_id, error is None, error or "")

    def close_session(self, msg: CloseSessionReq) -> None:
        """Its running turns go on as plain requests; its cached KV loses its priority."""
        self.sessions.close(msg.session_id)

    def expire_sessions(self) -> None:
        """Cheap when called often: the idle-timeout scan runs about once a second."""
        for sid in self.sessions.expire(time.monotonic()):
            logger.info("session %s expired (idle past its timeout)", sid)

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> BatchTokenIDOutput | None:
        self.last_heartbeat = now = time.monotonic()
        for req, reason in self.deadlines.expired(now, self.reqs):
            req.to_abort = reason
            self.aborting.append(req)
        self._process_aborts()
        self._poll_grammars(now)
        if not self.paused and not self._step_prefill() and self.running:
            self._step_decode()
        elif self.grammars and not (self.waiting or self.running or self.chunked_req):
            # only compilations are in flight: wait a little for one instead of spinning
            self.grammars.wait(GRAMMAR_WAIT_S)
        if self.is_idle():
            self.new_token_ratio = NEW_TOKEN_RATIO_INIT
            if self.args.check_invariants:
                self.check_idle_invariant()
        return self._take_outputs()

    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running or self.chunked_req or self.touched or self.aborting
            or self.pooled_done or self.grammars
        )  # fmt: skip

    def set_paused(self, paused: bool) -> None:
        """Paused, `step()` still ends aborted and expired requests but runs no forward."""
        if paused != self.paused:
            logger.info("generation %s", "paused" if paused else "continued")
        self.paused = paused

    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked_req or self.grammars)

    def _step_prefill(self) -> bool:
        """Admit what fits and prefill it. The running batch decodes in the same forward (a
        mixed step: one pass over the weights for both, and no decode stall while prompts
        arrive) when `_can_mix` allows it."""
        if not self.waiting and self.chunked_req is None:
            return False
        budget = self.args.max_prefill_tokens  # prompt tokens this step, all requests together
        if self.args.chunked_prefill_size > 0:
            budget = min(budget, self.args.chunked_prefill_size)
        adder = PrefillAdder(
            self.allocator, self.req_pool, self.tree, self.running, self.res.max_running_requests,
            budget, self.args.chunked_prefill_size, self.new_token_ratio,
        )  # fmt: skip
        if self.chunked_req is not None:
            adder.add_chunked(self.chunked_req)
        for req in sort_waiting(self.waiting, self.args.schedule_policy, self.tree):
            if adder.try_add(req) == AddResult.STOP:
                break
        if not adder.can_run:
            return False
        admitted = {id(r) for r in adder.can_run}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        num_new = sum(r.extend_len for r in adder.can_run)
        decoding = self.running if self._can_mix(adder.can_run, num_new) else []
        for req in decoding:
            req.extend_len = 1
        self._run_step(adder.can_run + decoding, prefill=True, spared=decoding)
        self.num_forward_steps += 1
        if decoding:
            self._decoded()
        self.chunked_req = None
        for req in adder.can_run:
            if req.is_finished:
                continue
            self._cache_unfinished(req)
            if req.is_chunked:
                self.chunked_req = req
            else:
                self.running.append(req)
        return True

    def _can_mix(self, new: list[Req], num_new: int) -> bool:
        """Whether the running batch can decode in this prefill's forward: allowed, on the CPU
        (whose attention kernel reads each row's own slots; CUDA's SDPA would pad every decode
        row to the prompt's length), its next tokens fit beside the prompts' (else the decode
        step that follows makes room), and the batch's padded [B, max_q, max_kv] attention
        metadata stays small."""
        if self.args.disable_mixed_prefill or not self.running:
            return False
        if self.runner.device.type != "cpu":
            return False
        room = self.allocator.available_size() + self.tree.evictable_size()
        if room < num_new + len(self.running):
            return False
        max_q = max(r.extend_len for r in new)
        max_kv = max(
            max(r.kv_committed_len + r.extend_len for r in new),
            max(r.kv_committed_len + 1 for r in self.running),
        )
        return (len(new) + len(self.running)) * max_q * max_kv <= MIX_MAX_PADDED

    def _step_decode(self) -> None:
        self._make_room_for_decode()
        self._run_step(self.running, prefill=False)
        self.num_forward_steps += 1
        self._decoded()

    def _decoded(self) -> None:
        """After a step in which the running batch decoded: drop its finished requests."""
        self.running = [r for r in self.running if not r.is_finished]
        self.new_token_ratio = max(
            NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )

    def _run_step(self, reqs: list[Req], prefill: bool, spared: list[Req] | None = None) -> None:
        """Plan, run and apply one forward (batch.py). A failing one ends the requests of that
        batch with a 500, never the process; its new slots go back (nobody committed them).
        `spared` (a mixed step's decoding requests) outlive a failure before anything was
        applied: they decode again in the next step, and end there if the fault was theirs."""
        applying = False
        try:
            slots = self.alloc_slots(sum(r.extend_len for r in reqs) if prefill else len(reqs))
            try:
                r2t, device = self.req_pool.req_to_token, self.runner.device
                plan = (plan_prefill if prefill else plan_decode)(reqs, r2t, slots, device)
                self._plan_grammar(plan)
                try:
                    out = execute(self.runner, plan)
                finally:  # the matchers are the loop's again only once the masks are filled
                    if plan.grammar_masks is not None:
                        wait_futures([plan.grammar_masks])
            except Exception:
                self.allocator.free(slots)
                raise
            applying = True
            self._apply_step(plan, out)
        except Exception as exc:
            kept = {id(r) for r in spared or ()} if not applying else set()
            logger.exception(
                "forward failed; aborting %d requests of the batch", len(reqs) - len(kept)
            )
            reason = internal_error(f"internal error: {type(exc).__name__}: {exc}")
            for req in reqs:
                if not req.is_finished and id(req) not in kept:
                    self.touched.append(req)
                    self.finish(req, reason)

    def _plan_grammar(self, plan: StepPlan) -> None:
        """Which constrained requests of the step check their greedy token against their grammar
        (a mask only if it is refused) and which have their masks filled beside the forward."""
        constrained = constrained_reqs(plan)
        if not constrained:
            return
        if self.grammars.check_first:
            plan.checked = [r for r in constrained if checks_first(r)]
            plan.fill_masks = self.grammars.fill_masks
        checked = {id(r) for r in plan.checked}
        plan.masked = [r for r in constrained if id(r) not in checked]
        if plan.masked:
            plan.grammar_masks = self.grammars.start_masks(plan.masked)

    # ---- per-request results ------------------------------------------------------------

    def _apply_step(self, plan: StepPlan, out: StepOutput) -> None:
        """The step's KV is committed; each request of `plan.last` gets its token, vector or
        error, and finishes when it is done."""
        for req, num in zip(plan.reqs, plan.new_lens, strict=True):
            req.kv_committed_len += num
        for req, lps, tops in out.input_logprobs:
            req.input_token_logprobs.extend(lps)
            req.input_top_logprobs.extend(tops)
        for i, req in enumerate(plan.last):
            token, error = out.tokens[i], out.errors[i]
            if token is not None:
                if req.return_logprob:
                    req.output_token_logprobs.append(out.logprobs[i])
                    req.output_top_logprobs.append(out.top_logprobs[i])
                self.on_token(req, token)
                continue
            if error is None and req.pooled is not None:
                req.pooled_result = out.pooled[i]
            self.touched.append(req)  # pooled, prompt-only (no tokens to go), or failed
            self.finish(req, error or FinishReason(type="length"))

    def on_token(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        reason = self.finish_checker.check(req)
        if req.grammar is not None:
            reason = advance_grammar(req, token, reason, self.eos_ids)
        self.touched.append(req)
        if reason is not None:
            self.finish(req, reason)

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        self._release(req)
        if req.session_id is not None:  # commit the turn, or roll an aborted one back
            self.sessions.on_finish(req, time.monotonic())

    # ---- memory -------------------------------------------------------------------------

    def _release(self, req: Req) -> None:
        """Hand a request's KV to the cache (or free it) and drop its row and lock."""
        if req.req_pool_idx is not None:
            kv = req.committed_kv(self.req_pool.req_to_token)
            fill = req.fill_ids[: req.kv_committed_len]
            self.tree.cache_finished(
                fill, kv, req.cache_protected_len, req.last_node, req.session_id
            )
            self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        self.reqs.pop(req.rid, None)

    def _cache_unfinished(self, req: Req) -> None:
        kv = req.committed_kv(self.req_pool.req_to_token)
        fill = req.fill_ids[: req.kv_committed_len]
        res = self.tree.cache_unfinished(
            fill, kv, req.cache_protected_len, req.last_node, req.session_id
        )
        self.req_pool.req_to_token[req.req_pool_idx, : len(res.indices)] = res.indices
        req.last_node, req.cache_protected_len = res.last_node, res.cache_protected_len

    def _ensure_free(self, num: int) -> None:
        short = num - self.allocator.available_size()
        if short > 0:  # open sessions' conversations go last
            self.tree.evict(short, keep_tags=self.sessions.sessions)

    def alloc_slots(self, num: int) -> torch.Tensor:
        self._ensure_free(num)
        slots = self.allocator.alloc(num)
        if slots is None:
            raise RuntimeError(
                f"KV pool exhausted: need {num}, free {self.allocator.available_size()}"
            )
        return slots

    def _make_room_for_decode(self) -> None:
        """Retract requests until the next decode step fits; keeps at least one running."""

        def fits(extra: int) -> bool:
            return self.allocator.available_size() + self.tree.evictable_size() >= extra

        if fits(len(self.running)):
            return
        order = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        retracted = []
        while len(self.running) > 1 and not fits(len(self.running) * RETRACT_HEADROOM_STEPS):
            victim = order.pop(0)
            self.running.remove(victim)
            self._release(victim)
            self.reqs[victim.rid] = victim
            victim.reset_for_retract()
            retracted.append(victim)
        self.num_retractions += len(retracted)
        self.waiting = retracted + self.waiting
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        logger.info(
            "KV pool full: retracted %d requests (%d running, %d free slots)",
            len(retracted), len(self.running), self.allocator.available_size(),
        )  # fmt: skip

    # ---- aborts and outputs ---------------------------------------------------------------

    def _process_aborts(self) -> None:
        """End every request marked `to_abort`, in whatever phase it is (waiting, chunked
        prefill, running), through the one release path; one pass over the queues."""
        if not self.aborting:
            return
        ending = {id(r) for r in self.aborting if self.reqs.get(r.rid) is r}
        aborting, self.aborting = self.aborting, []
        self.waiting = [r for r in self.waiting if id(r) not in ending]
        self.running = [r for r in self.running if id(r) not in ending]
        if self.grammars:
            self.grammars.discard(ending)
        if self.chunked_req is not None and id(self.chunked_req) in ending:
            self.chunked_req = None
        for req in aborting:
            if id(req) in ending and not req.is_finished:
                self.touched.append(req)
                self.finish(req, req.to_abort)

    def _take_outputs(self) -> BatchTokenIDOutput | None:
        """Generation requests report now; finished pooled ones wait for
        `take_embedding_output` (they only ever appear in `touched` once finished)."""
        if not self.touched:
            return None
        touched, self.touched = self.touched, []
        self.pooled_done.extend(r for r in touched if r.pooled is not None)
        generation = [r for r in touched if r.pooled is None]
        return build_output(generation, self.args.stream_interval)

    def take_embedding_output(self) -> BatchEmbeddingOutput | None:
        """The pooled requests finished since the last call, as one message (None if none)."""
        done, self.pooled_done = self.pooled_done, []
        return build_embedding_output(done)

    # ---- introspection --------------------------------------------------------------------

    def internal_state(self) -> InternalState:
        total = self.allocator.size
        free = self.allocator.available_size()
        cached = self.tree.total_size()
        return InternalState(
            num_running_reqs=len(self.running) + (self.chunked_req is not None),
            num_waiting_reqs=len(self.waiting),
            kv_total=total, kv_free=free, kv_cached=cached, kv_in_use=total - free - cached,
            last_heartbeat=self.last_heartbeat, num_retractions=self.num_retractions,
            num_sessions=len(self.sessions), device=str(self.res.device),
            dtype=str(self.res.dtype).removeprefix("torch."), paused=self.paused,
            num_grammar_reqs=len(self.grammars or ()),
        )  # fmt: skip

    def check_idle_invariant(self) -> None:
        """At idle every slot is free or held by the cache, and nothing holds a request row."""
        assert self.is_idle(), "check_idle_invariant called while requests are live"
        free, cached = self.allocator.available_size(), self.tree.total_size()
        if free + cached != self.allocator.size:
            raise AssertionError(
                f"KV leak: free {free} + cached {cached} != total {self.allocator.size}"
            )
        if self.tree.protected_size() != 0:
            raise AssertionError(f"radix cache still locked: {self.tree.protected_size()} tokens")
        if self.req_pool.available_size() != self.req_pool.size:
            raise AssertionError("request rows leaked")
        if self.reqs:
            raise AssertionError(f"requests left behind: {list(self.reqs)[:5]}")

    def flush_cache(self) -> bool:
        if not self.is_idle():
            return False
        self.tree.reset()
        self.allocator.clear()
        return True


def _abort_reason(cause: str) -> FinishReason:
    return shutdown() if cause == "shutdown" else aborted()
