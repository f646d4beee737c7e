"""Loop-side state of one request: turns what the scheduler appended to a `Req` into deltas.

Owned by the engine loop thread.  Text is detokenized incrementally and checked for stop strings
here, in the engine layer, because the scheduler only sees token ids.
"""

from __future__ import annotations

from collections.abc import Callable

from graphexec.batch.request import FinishReason, Req
from graphexec.engine.request_output import RequestDelta, RequestOutput
from graphexec.text.detokenizer import Decoder, IncrementalDetokenizer
from graphexec.text.stop_strings import StopStringMatcher

# Receives each delta, or the exception that ended the request; False when nobody will read it.
Sink = Callable[[RequestDelta | BaseException], bool]


class RequestTracker:
    def __init__(self, req: Req, sink: Sink, tokenizer: Decoder | None, arrival_time: float):
        self.req = req
        self.sink = sink
        self.arrival_time = arrival_time
        self.abort_requested = False
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = StopStringMatcher(req.params.stop)
        self._sent_tokens = 0
        self._text = ""  # decoded so far (cut at a stop string), sent or held back
        self._sent_chars = 0
        self._searched_chars = 0
        self._stop_string_matched = False
        # Output tokens up to the one that completed a stop string (None: no match yet).
        self._token_limit: int | None = None
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self._prompt_logprobs_sent = False

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def stop_string_matched(self) -> bool:
        """The text reached a stop string; the scheduler may not know yet that the request is over."""
        return self._stop_string_matched

    @property
    def finished(self) -> bool:
        return self.req.finished or self._stop_string_matched

    def collect(self, now: float) -> RequestDelta | None:
        """The delta since the previous call; None when there is nothing to tell."""
        req = self.req
        new_ids = req.output_ids[self._sent_tokens :]
        if not new_ids and not self.finished:
            return None
        start = self._sent_tokens
        self._sent_tokens = len(req.output_ids)
        if new_ids:
            self._first_token_time = self._first_token_time or now
            self._last_token_time = now
        self._decode(new_ids, start, final=req.finished)
        if self._token_limit is not None:  # tokens past the stop string's last are not output
            new_ids = new_ids[: max(0, self._token_limit - start)]
            self._sent_tokens = min(self._sent_tokens, self._token_limit)
        done = self.finished
        end = len(self._text) if done else len(self._text) - self._stop.held_back(self._text)
        text = self._text[self._sent_chars : max(end, self._sent_chars)]
        self._sent_chars += len(text)
        logprobs = req.output_logprobs[start : self._sent_tokens] if req.params.logprobs is not None else None
        prompt_logprobs = self._unsent_prompt_logprobs()
        if not done:
            return RequestDelta(req.rid, list(new_ids), text, logprobs, prompt_logprobs=prompt_logprobs)
        reason = FinishReason.STOP if self._stop_string_matched else req.finish_reason
        output = self._output(reason, now)
        return RequestDelta(req.rid, list(new_ids), text, logprobs, reason.value, output, prompt_logprobs)

    def _unsent_prompt_logprobs(self) -> list[dict | None] | None:
        """The prompt's logprobs, on the first delta only: a request's first delta comes after its
        prefill (its first token, or its end with max_new_tokens=0), so every entry is filled, unless
        it was aborted before."""
        if self._prompt_logprobs_sent or self.req.prompt_logprobs is None:
            return None
        self._prompt_logprobs_sent = True
        return list(self.req.prompt_logprobs)

    def _decode(self, new_ids: list[int], first_index: int, *, final: bool) -> None:
        """Add the text of output tokens first_index, first_index + 1, ...; look for stop strings.

        With stop strings the tokens are decoded and searched one at a time, as if each step
        yielded one: a step that yields several (speculative verification) ends the output at the
        token that completes a stop string, as a one-token step would have."""
        if self._detokenizer is None or self._stop_string_matched:
            return
        # As in vLLM, a stop string cannot end a request before min_tokens outputs: the text of
        # those tokens counts as searched, so only a match that ends after it is a stop.
        min_tokens = self.req.params.min_tokens
        unchecked = min(len(new_ids), max(0, min_tokens - first_index))
        if unchecked:
            self._text += self._detokenizer.push(new_ids[:unchecked])
            self._searched_chars = len(self._text)
        rest = new_ids[unchecked:]
        if not self._stop:
            self._text += self._detokenizer.push(rest) if rest else ""
            self._text += self._detokenizer.flush() if final else ""
            return
        for i, token in enumerate(rest):
            self._text += self._detokenizer.push([token])
            if final and i == len(rest) - 1:
                self._text += self._detokenizer.flush()
            if self._stop_found():
                self._token_limit = first_index + unchecked + i + 1
                return
        if final and not rest:
            self._text += self._detokenizer.flush()
            if first_index >= min_tokens and self._stop_found():
                self._token_limit = first_index

    def _stop_found(self) -> bool:
        cut = self._stop.find(self._text, self._searched_chars)
        self._searched_chars = len(self._text)
        if cut is None:
            return False
        self._text = self._text[:cut]
        self._stop_string_matched = True
        return True

    def _output(self, reason: FinishReason, now: float) -> RequestOutput:
        req = self.req
        first, last = self._first_token_time, self._last_token_time
        token_ids = req.output_ids[: self._token_limit]
        n = len(token_ids)
        return RequestOutput(
            request_id=req.rid,
            prompt_token_ids=list(req.prompt_ids),
            text=self._text,
            token_ids=token_ids,
            finish_reason=reason.value,
            logprobs=req.output_logprobs[:n] if req.params.logprobs is not None else None,
            ttft=None if first is None else first - self.arrival_time,
            tpot=(last - first) / (n - 1) if first is not None and last is not None and n > 1 else None,
            latency=now - self.arrival_time,
            cached_tokens=req.num_reused_tokens,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            # A stop string ended the text before any stop token could come.
            stop_token_id=None if self._stop_string_matched else req.matched_stop_token,
        )
