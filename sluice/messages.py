"""Messages that cross process boundaries, and nothing else does.

Flat msgspec structs with no logic, encoded with msgpack over ZMQ. Token ids travel as plain
integer lists. Single and batch requests are different types.

Sections by receiver: what the scheduler takes (from the HTTP process), what the detokenizer
takes (from the scheduler), what the HTTP process takes (from the detokenizer, or straight from
an encoder's scheduler), what HTTP workers send each other, and the launcher's start-up
handshake. A struct sent on its own is a
`Message`, tagged with its class name; each receiver decodes the closed union of what it takes
(`ToScheduler`, `ToDetokenizer`, `ToHttp`, `ToPeer`, at the end) by that tag and dispatches with `match`.
The structs of the first section travel only inside messages.
"""

from __future__ import annotations

import msgspec

# ---------------------------------------------------------------------------- carried inside


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Per-request sampling parameters, already validated by the TokenizerManager.

    `max_new_tokens` is None only before the context limit is applied; the scheduler always
    receives a concrete value.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # at most one grammar (scheduler/grammar.py): a JSON schema (JSON text), a regular expression
    # the whole output matches, or a Lark/GBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class SessionParams(msgspec.Struct, omit_defaults=True):
    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


class FinishReason(msgspec.Struct, omit_defaults=True):
    """Why a request ended. type: "stop" | "length" | "abort".

    For "stop", `matched` is the token id (EOS or a stop token id) or the stop string that
    matched. For "abort", `message`, `status_code` and `code` describe the error to return; the
    aborts are built by the named constructors of `sluice.aborts`, in one place.
    """

    type: str
    matched: int | str | None = None
    message: str | None = None
    status_code: int = 0
    code: str | None = None


class TopLogprobs(msgspec.Struct, array_like=True):
    token_ids: list[int]
    logprobs: list[float]


class InternalState(msgspec.Struct):
    num_running_reqs: int
    num_waiting_reqs: int
    kv_total: int
    kv_free: int
    kv_cached: int
    kv_in_use: int
    last_heartbeat: float
    num_retractions: int = 0
    num_sessions: int = 0
    device: str = ""  # where the model runs, as resolved at start-up (e.g. "cpu", "cuda")
    dtype: str = ""  # e.g. "float32"
    paused: bool = False  # by /pause_generation: no forward step runs until it is continued
    num_grammar_reqs: int = 0  # requests waiting for their grammar to compile


class ModelInfo(msgspec.Struct, omit_defaults=True):
    """What a model process reports when it is ready: its settings as resolved at start-up."""

    model_name: str
    hf_dir: str
    context_len: int
    vocab_size: int
    task: str = "generate"  # "generate" | "embed" | "rerank"
    dimensions: int = 0  # width of a pooled vector (an embedding; the decoder's hidden size)
    max_total_tokens: int = 0  # the KV pool; 0: none (an encoder)
    max_running_requests: int = 0
    num_threads: int = 0
    device: str = ""
    dtype: str = ""


class ImageItem(msgspec.Struct):
    """One processed image of a prompt (one tile of it, for a model that splits images into
    tiles): its pixels, and the positions [offset, offset + length) of the prompt it fills
    (whose ids, made from `hash`, lie outside the vocabulary; see sluice/tokenizer/images.py).
    `pixel_values` are the processor's output as little-endian bytes in C order, of `shape`
    ([C, H, W]) and `dtype` (a numpy name)."""

    hash: str  # sha256 of the image's bytes (of a tile: of the image's hash and index), hex
    offset: int
    length: int
    pixel_values: bytes
    shape: list[int]
    dtype: str = "float32"


class Message(msgspec.Struct, tag=True):
    """A struct sent on its own: it travels tagged with its class name (field "type")."""


# ---------------------------------------------------------------------------- to the scheduler


class TokenizedGenerateReqInput(Message, omit_defaults=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    # first prompt position whose logprob is returned; -1: none of the prompt
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    session_params: SessionParams | None = None
    # seconds; 0 means no per-request timeout
    timeout: float = 0.0
    # address of the TokenizerManager that owns this request (multi-worker routing)
    reply_to: str = ""
    # the grammar (if any) applies only after this token is generated (the end of a model's
    # reasoning, e.g. `</think>`), and the stop tokens are blocked until then; -1: from the
    # first token. With `reasoning_start_id` (e.g. `<think>`) the reasoning is optional: a first
    # token other than that one means there is none, and the grammar applies from it on
    grammar_after_id: int = -1
    reasoning_start_id: int = -1
    images: list[ImageItem] = []  # in order of offset; empty: a text-only prompt


class BatchTokenizedGenerateReqInput(Message):
    reqs: list[TokenizedGenerateReqInput]


class TokenizedEmbeddingReqInput(Message, omit_defaults=True):
    """One input of an embedding or scoring request (prefill only, no generated tokens).

    For an encoder model: the pooled vector, or a cross-encoder's scores; `token_type_ids` is set
    for a (query, document) pair of a cross-encoder.
    For a decoder model, `label_token_ids` picks the mode:
      - None: an embedding, the final-norm hidden state of the last prompt token, L2-normalized;
      - a list: scores, the log-probabilities (log_softmax over the whole vocabulary at the last
        prompt position, i.e. of the next token) of exactly these token ids, in this order.
    An encoder refuses `label_token_ids` (400). Results travel as float32 in a
    BatchEmbeddingOutput.
    """

    rid: str
    input_ids: list[int]
    token_type_ids: list[int] | None = None
    label_token_ids: list[int] | None = None
    reply_to: str = ""


class BatchTokenizedEmbeddingReqInput(Message):
    reqs: list[TokenizedEmbeddingReqInput]


class AbortReq(Message, omit_defaults=True):
    """HTTP → the scheduler, and → the detokenizer (which drops the rid's decode state).
    `reason`: "client" (a disconnect or /abort_request) or "shutdown" (the drain ran out).
    `reply_to`: the aborting HTTP worker; only its own requests are aborted (another worker's
    request with the same rid, which the scheduler refused as a duplicate, is left alone; the
    other workers abort theirs when asked over their peer socket). Empty: whoever owns it."""

    rid: str = ""
    abort_all: bool = False
    reason: str = "client"
    reply_to: str = ""


class SetPausedReq(Message):
    """HTTP → a model's scheduler, fire and forget (ordered with the requests on the same
    socket): paused, the scheduler runs no forward step; requests queue, aborts and timeouts
    are still processed."""

    paused: bool


class FlushCacheReq(Message):
    reply_to: str = ""  # the asking HTTP worker's address; the reply goes there


class GetInternalStateReq(Message):
    reply_to: str = ""


class OpenSessionReq(Message, omit_defaults=True):
    """Open a session (the TokenizerManager picks `session_id` when the client gave none).

    `timeout`: seconds idle (no turn running) before the scheduler closes it; 0: never.
    `capacity_of_str_len`: the most tokens a turn's prompt (its context plus the new text) may
    hold, a longer turn is refused with 400; 0: no limit.
    """

    session_id: str
    timeout: float = 0.0
    capacity_of_str_len: int = 0
    reply_to: str = ""


class CloseSessionReq(Message):
    """Fire and forget: close a session; an unknown id is ignored."""

    session_id: str


# ---------------------------------------------------------------------------- to the detokenizer


class BatchTokenIDOutput(Message):
    """Scheduler → detokenizer. Lists are parallel, one entry per request in this update.

    `new_token_ids[i]` are the tokens produced since the previous update for `rids[i]`.
    Logprob lists are empty unless the request asked for logprobs; they hold the entries for
    `new_token_ids` only. `input_token_logprobs` is sent once, with the first update.
    """

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    stop_strings: list[list[str]]
    no_stop_trim: list[bool]
    output_token_logprobs: list[list[float]]
    output_top_logprobs: list[list[TopLogprobs]]
    input_token_logprobs: list[list[float | None]]
    input_top_logprobs: list[list[TopLogprobs | None]]
    reply_to: list[str]


# ---------------------------------------------------------------------------- to the HTTP process
# BatchStrOutput is the detokenizer's; the others are the scheduler's, passed on unchanged by
# the detokenizer (an encoder's scheduler sends them straight to its manager)


class BatchStrOutput(Message):
    """Detokenizer → TokenizerManager. `texts[i]` is the new text since the previous update."""

    rids: list[str]
    texts: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[float]]
    output_top_logprobs: list[list[TopLogprobs]]
    input_token_logprobs: list[list[float | None]]
    input_top_logprobs: list[list[TopLogprobs | None]]


class BatchEmbeddingOutput(Message):
    """Scheduler (encoder or decoder) → (detokenizer, unchanged) → its manager. Lists are
    parallel; it answers TokenizedEmbeddingReqInput and BatchTokenizedEmbeddingReqInput.

    `embeddings[i]` is the pooled vector (a cross-encoder's scores, or a decoder's label-token
    logprobs) of `rids[i]` as little-endian float32 bytes; empty when `finished_reasons[i]` is an
    abort. `cached_tokens` (prompt tokens served from the prefix cache) is filled by the decoder
    scheduler only; an encoder leaves it empty.
    """

    rids: list[str]
    embeddings: list[bytes]
    prompt_tokens: list[int]
    finished_reasons: list[FinishReason]
    reply_to: list[str]
    cached_tokens: list[int] = []


class InternalStateReply(Message):
    """Scheduler → detokenizer → TokenizerManager, answering GetInternalStateReq.

    The detokenizer fills `num_detokenizer_states` on the way through, so both figures describe
    the same moment of the scheduler's output stream.
    """

    state: InternalState
    num_detokenizer_states: int = 0
    reply_to: str = ""  # copied from the request: the worker it goes back to


class FlushCacheReply(Message):
    """Scheduler → detokenizer → TokenizerManager, answering FlushCacheReq."""

    success: bool
    reply_to: str = ""


class OpenSessionReply(Message, omit_defaults=True):
    """Scheduler → detokenizer → TokenizerManager, answering OpenSessionReq."""

    session_id: str
    success: bool
    message: str = ""
    reply_to: str = ""


class SchedulerHeartbeat(Message):
    """Scheduler → detokenizer → TokenizerManager, at least every heartbeat interval, busy or
    idle: the readiness check's proof that the scheduler loop turns."""

    num_running_reqs: int
    num_waiting_reqs: int


# ---------------------------------------------------------------------------- between HTTP workers
# With --tokenizer-worker-num N > 1, each HTTP worker has a peer socket (`IpcAddrs.peers`): a
# request to "every worker" (an abort by rid, abort_all, the request states, the metrics) is
# answered by the worker it reached and by each other one, whose replies it gathers by `seq`.
# `sender` is the asking worker's index; the first worker (the launcher) also sends the last two.


class PeerAbortReq(Message, omit_defaults=True):
    """Abort `rid` (or, with `abort_all`, every request of every model) here."""

    seq: int
    sender: int
    rid: str = ""
    abort_all: bool = False


class PeerAbortReply(Message):
    seq: int
    worker: int  # the answering worker's index (as in every reply: what its call waits for)
    num_aborted: int


class PeerStateReq(Message):
    seq: int
    sender: int


class PeerStateReply(Message):
    """This worker's request states (as `num_req_states` counts them) and its identity."""

    seq: int
    worker: int
    pid: int
    num_req_states: int
    encoder_req_states: dict[str, int] = {}  # pending pooled requests, by encoder model name


class PeerMetricsReq(Message):
    seq: int
    sender: int


class MetricSample(msgspec.Struct, array_like=True):
    """One additive Prometheus sample (a counter's or a histogram's)."""

    name: str
    labels: dict[str, str]
    value: float


class PeerMetricsReply(Message):
    seq: int
    worker: int
    samples: list[MetricSample]
    num_prompt_tokens: int = 0  # behind the cache hit rate
    num_cached_tokens: int = 0


class PeerErrorReply(Message):
    """The reply to any request whose handler raised (or had no answer): the call stops
    waiting for this worker at once and leaves it out."""

    seq: int
    worker: int
    error: str


class PeerLeaving(Message):
    """A worker is going (its server stopped after a drain or a failure): nobody waits for
    its replies any longer, and nothing more is sent to it."""

    worker: int


class PeerFailure(Message):
    """A process of the server died: fail every request with 503 `message`, then exit."""

    message: str


class PeerDrain(Message):
    """The launcher got SIGTERM (or Ctrl-C): drain as it does (`GracefulShutdown`), then exit."""


# ---------------------------------------------------------------------------- to the launcher


class ReadyMsg(Message):
    """A child process's start-up handshake, on its pipe (`info`: a model process's, when it is
    one)."""

    process: str
    info: ModelInfo | None = None
    error: str | None = None


# ---------------------------------------------------------------------------- by receiver

ToScheduler = (
    TokenizedGenerateReqInput | BatchTokenizedGenerateReqInput | TokenizedEmbeddingReqInput
    | BatchTokenizedEmbeddingReqInput | AbortReq | SetPausedReq | FlushCacheReq
    | GetInternalStateReq | OpenSessionReq | CloseSessionReq
)  # fmt: skip
# what the scheduler sends that only the HTTP process reads: the detokenizer passes it on
PassedOn = (
    BatchEmbeddingOutput | InternalStateReply | FlushCacheReply | OpenSessionReply
    | SchedulerHeartbeat
)  # fmt: skip
ToDetokenizer = BatchTokenIDOutput | AbortReq | PassedOn
ToHttp = BatchStrOutput | PassedOn
ToPeer = (
    PeerAbortReq | PeerAbortReply | PeerStateReq | PeerStateReply | PeerMetricsReq
    | PeerMetricsReply | PeerErrorReply | PeerLeaving | PeerFailure | PeerDrain
)  # fmt: skip
