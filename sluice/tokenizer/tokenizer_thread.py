"""TokenizerThread: the one thread that calls a Hugging Face tokenizer off the event loop.

A fast tokenizer must not be called from two threads at once (a call that changes its
truncation or padding while another encodes raises "Already borrowed"). Invariant: the thread's
count of unfinished calls is above zero from before a call is queued until after it returned,
so when `is_idle()` is true on the event loop (the only thread that queues calls), the loop may
call the tokenizer itself and the two never overlap. Short work runs there: handing it to the
thread and waking the loop again costs more than encoding a chat turn.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

INLINE_MAX_CHARS = 2048  # text up to this long is encoded on the loop when the thread is idle


class TokenizerThread(ThreadPoolExecutor):
    def __init__(self, thread_name_prefix: str) -> None:
        super().__init__(max_workers=1, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self._num_unfinished = 0  # queued or running calls

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            self._num_unfinished += 1
        try:
            fut = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._finished(None)
            raise
        fut.add_done_callback(self._finished)  # in the thread, once `fn` returned or raised
        return fut

    def _finished(self, _: Future | None) -> None:
        with self._lock:
            self._num_unfinished -= 1

    def is_idle(self) -> bool:
        return self._num_unfinished == 0
