"""What one HTTP request may be, checked before anything is queued: the size and read time of its
body, and its prompt + max_tokens against the engine's per-request bound.

The bound is `Engine.max_request_tokens` (the context, or the KV pool if smaller); messages also
quote the model's context.  Reading the headers in time is the protocol's job (uvicorn_setup.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from graphexec.server.errors import APIError, bad_request

# A 408 ends the connection: the client is stalled mid-body.  A 413 does not: the client is
# likely still sending, and closing with its bytes unread would reset the connection and lose the
# answer; the protocol discards the rest, within server.request_read_timeout_s (uvicorn_setup.py).
_CLOSE = {"Connection": "close"}

# OpenAI's error code for prompt + completion over the context, which its clients check for.
_CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytearray:
    """The whole body, or an APIError: 413 past `max_bytes`, 408 when not read within `timeout_s`.

    A declared Content-Length over the limit answers before a byte of the body is read; without
    one (chunked), reading stops at the first chunk that passes the limit.  Either way the server
    holds at most `max_bytes` plus one chunk (uvicorn pauses the socket beyond 64 KiB unread), and
    what the client sends after the answer is discarded as it arrives.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes, f"Content-Length is {declared}")
    try:
        return await asyncio.wait_for(_read_capped(request, max_bytes), timeout_s)
    except TimeoutError:
        raise APIError(
            408, f"request body not received within {timeout_s:g} s (server.request_read_timeout_s)",
            type="invalid_request_error", code="request_timeout", headers=_CLOSE,
        ) from None


async def _read_capped(request: Request, max_bytes: int) -> bytearray:
    # One growing bytearray, not a list of chunks: a large buffer is one mmap that glibc returns
    # to the OS when freed, where thousands of small chunks would leave the heap fragmented.
    body = bytearray()
    stream = request.stream()
    try:
        async for chunk in stream:
            body += chunk
            if len(body) > max_bytes:
                raise _too_large(max_bytes, f"more than {max_bytes} bytes were sent")
    finally:
        await stream.aclose()
    return body


def _too_large(max_bytes: int, seen: str) -> APIError:
    return APIError(
        413, f"request body is larger than {max_bytes} bytes (server.max_body_bytes): {seen}",
        type="invalid_request_error", code="request_too_large",
    )


@dataclass(frozen=True)
class TokenBound:
    """How many tokens one request may hold (prompt + completion), and what to do beyond."""

    max_context: int  # the model's
    max_request_tokens: int  # the bound itself: max_context, or the KV pool if smaller
    clamp: bool  # server.clamp_max_tokens

    def max_new_tokens(
        self, prompt_tokens: int, requested: int | None, *, field: str, prompt_field: str, default: int | None = None
    ) -> int:
        """The completion's length: `requested` if it fits, else clamped or a 400 naming `field`;
        omitted, `default` or the room left after the prompt, whichever is smaller (a default the
        client never sent is never its error).  A prompt that leaves no room is a 400 naming
        `prompt_field` ("prompt" or "messages")."""
        room = self.max_request_tokens - prompt_tokens
        if room < 1:
            raise bad_request(
                f"{self._limit()}. However, your {prompt_field} has {prompt_tokens} tokens, which leaves no "
                f"room for the completion. Please reduce the length of the {prompt_field}.",
                param=prompt_field, code=_CONTEXT_LENGTH_EXCEEDED,
            )
        if requested is None:
            return room if default is None else min(default, room)
        if requested <= room:
            return requested
        if self.clamp:
            return room
        raise bad_request(
            f"{self._limit()}. However, you requested {prompt_tokens + requested} tokens ({prompt_tokens} in "
            f"the {prompt_field}, {requested} for the completion). Please reduce the length of the "
            f"{prompt_field} or {field} (at most {room} here).",
            param=field, code=_CONTEXT_LENGTH_EXCEEDED,
        )

    def _limit(self) -> str:
        # vLLM's wording, which clients and people already recognise.
        limit = f"This model's maximum context length is {self.max_context} tokens"
        if self.max_request_tokens < self.max_context:
            limit += f" and this server's KV cache holds {self.max_request_tokens} tokens per request"
        return limit
