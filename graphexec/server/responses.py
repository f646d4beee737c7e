"""Response bodies and stream chunks of the OpenAI-compatible API, built from engine outputs.

Plain dicts: the shapes are OpenAI's (the official client parses them), and building them
directly keeps one place that says what goes over the wire.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from graphexec.engine.request_output import RequestOutput
from graphexec.server.tool_parsers import ParsedReply
from graphexec.text.detokenizer import IncrementalDetokenizer


def sse(payload: dict | str) -> str:
    """One server-sent event; the stream ends with the literal `[DONE]`."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def tool_finish_reason(called: bool, finish_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself with calls; "length" stays, since
    text cut short is worth knowing about even when calls came before it."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def usage(outputs: Sequence[RequestOutput], n: int) -> dict:
    """Usage of one response: `outputs` are its choices, prompt-major, `n` per prompt.  Each prompt
    counts once (as OpenAI and vLLM bill it), with its first choice's prefix-cache hits; every
    choice's completion counts."""
    firsts = outputs[::n]
    prompt_tokens = sum(o.prompt_tokens for o in firsts)
    completion_tokens = sum(o.completion_tokens for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts)},
    }


@dataclass(frozen=True)
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str

    def completion(self, choices: list[dict], usage: dict) -> dict:
        return self._body("text_completion", choices) | {"usage": usage}

    @staticmethod
    def completion_choice(index: int, output: RequestOutput, logprobs: dict | None, echoed: str = "") -> dict:
        text = echoed + output.text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": output.finish_reason}

    def completion_chunk(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._body("text_completion", [choice])

    def chat(self, choices: list[dict], usage: dict) -> dict:
        return self._body("chat.completion", choices) | {"usage": usage}

    @staticmethod
    def chat_choice(index: int, output: RequestOutput, logprobs: dict | None, reply: ParsedReply | None = None) -> dict:
        """`reply`: the output read for tool calls, when the request offered tools."""
        if reply is None:
            message = {"role": "assistant", "content": output.text}
            finish_reason = output.finish_reason
        else:
            message = {"role": "assistant", "content": reply.content}
            if reply.calls:
                message["tool_calls"] = [call.as_openai() for call in reply.calls]
            finish_reason = tool_finish_reason(bool(reply.calls), output.finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def chat_chunk(self, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._body("chat.completion.chunk", [choice])

    def usage_chunk(self, usage: dict, object_name: str) -> dict:
        return self._body(object_name, []) | {"usage": usage}

    def _body(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}


@dataclass
class LogprobsFormatter:
    """graphexec's logprob entries ({token_id, logprob, top: [(id, logprob)]}) in OpenAI's shapes.

    One per choice: it keeps the text offset across the chunks of one streamed completion.  The
    offsets index the choice's `text`, which leaves special tokens out (an EOS generated under
    ignore_eos) and holds whole characters: they come from the same incremental detokenization
    the engine makes the text with, not from the token strings (which spell special tokens).
    """

    tokenizer: object
    text_offset: int = field(default=0)
    _detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, entries: Sequence[dict] | None) -> dict | None:
        """Legacy completions: parallel lists; top_logprobs holds the chosen token and the top k."""
        if entries is None:
            return None
        if self._detokenizer is None:
            self._detokenizer = IncrementalDetokenizer(self.tokenizer)
        tokens, offsets, tops = [], [], []
        for entry in entries:
            text = self.token(entry["token_id"])
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(self._detokenizer.push([entry["token_id"]]))
            top = {self.token(i): lp for i, lp in entry.get("top", [])}
            tops.append({text: entry["logprob"]} | top)
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def echo(self, prompt_ids: Sequence[int], entries: Sequence[dict | None] | None) -> tuple[str, dict | None]:
        """The prompt as echoed in front of a completion: its text (decoded as sent, special tokens
        spelled out) and, given prompt logprob entries, its legacy logprobs (null for the first
        token, which nothing predicts).  Offsets index that text; the completion's continue after it."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
        text, offsets = "", []
        for token_id in prompt_ids:
            offsets.append(len(text))
            text += detokenizer.push([token_id])
        text += detokenizer.flush()
        self.text_offset = len(text)
        if entries is None:
            return text, None
        tokens = [self.token(i) for i in prompt_ids]
        tops = [None] + [{tokens[k]: e["logprob"]} | {self.token(i): lp for i, lp in e.get("top", [])} for k, e in enumerate(entries) if k]
        logprobs = [None] + [e["logprob"] for e in entries[1:]]
        return text, {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def joined(first: dict | None, second: dict | None) -> dict | None:
        """Two legacy logprobs objects as one (the echoed prompt's, then the completion's)."""
        if first is None or second is None:
            return first or second
        return {key: first[key] + second[key] for key in first}

    def chat(self, entries: Sequence[dict] | None) -> dict | None:
        if entries is None:
            return None
        return {
            "content": [
                self._chat_token(e["token_id"], e["logprob"])
                | {"top_logprobs": [self._chat_token(i, lp) for i, lp in e.get("top", [])]}
                for e in entries
            ]
        }

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
