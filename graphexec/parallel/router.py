"""Which data-parallel replica serves a request: least-loaded, with prefix affinity.

Pure logic, no I/O: the front (graphexec/server/front.py) keeps the in-flight count of each
replica and hands it in; this module only decides.  A prompt's prefix key (`prefix_key`) names
what a replica's prefix cache would reuse: the first characters of the chat messages (system
prompt and the first turns) or of the completion prompt.  A key seen before goes back to the
replica that served it, so a shared system prompt stays in one replica's KV cache, unless that
replica's load exceeds the least-loaded replica's by more than `parallel.dp_affinity_slack`; then
the least-loaded one takes the request (counted as an override) and the key keeps its replica.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Characters of the rendered prompt that make a prefix key.  Long enough that a shared system
# prompt alone decides the key (its KV is what the prefix cache would reuse), short enough to hash
# cheaply; prompts differing earlier than this are different prefixes.
PREFIX_CHARS = 256
# Prefix keys remembered (least recently routed forgotten first).
MAX_PREFIXES = 4096


class NoReplicaError(RuntimeError):
    """Every replica is down."""


@dataclass
class RouterCounters:
    routed: int = 0  # requests routed
    affinity_hits: int = 0  # a known prefix went to its replica
    affinity_overridden: int = 0  # a known prefix went elsewhere: its replica was too loaded
    per_replica: list[int] = field(default_factory=list)  # routed to each replica

    def as_dict(self) -> dict[str, Any]:
        return {
            "routed": self.routed,
            "affinity_hits": self.affinity_hits,
            "affinity_overridden": self.affinity_overridden,
            "routed_per_replica": list(self.per_replica),
        }


class Router:
    """Routing state of one front: the affinity table (LRU), the replicas taken down, counters."""

    def __init__(self, num_replicas: int, affinity_slack: int = 4, max_prefixes: int = MAX_PREFIXES):
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas
        self.affinity_slack = affinity_slack
        self.max_prefixes = max_prefixes
        self.counters = RouterCounters(per_replica=[0] * num_replicas)
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._down: set[int] = set()

    @property
    def alive(self) -> list[int]:
        return [i for i in range(self.num_replicas) if i not in self._down]

    def mark_down(self, replica: int) -> None:
        """Send nothing more to `replica` (it died); its prefixes find a new home when next seen."""
        self._down.add(replica)

    def mark_up(self, replica: int) -> None:
        self._down.discard(replica)

    def is_down(self, replica: int) -> bool:
        return replica in self._down

    def known_prefixes(self) -> int:
        return len(self._affinity)

    def pick(self, key: str | None, loads: Sequence[int]) -> int:
        """The replica for a request with prefix `key` (None: no affinity), given each replica's
        in-flight requests."""
        alive = self.alive
        if not alive:
            raise NoReplicaError("every data-parallel replica is down")
        least = min(alive, key=lambda i: (loads[i], self.counters.per_replica[i], i))
        choice = least
        home = self._affinity.get(key) if key is not None else None
        if home is not None and home not in self._down:
            if loads[home] - loads[least] <= self.affinity_slack:
                choice = home
                self.counters.affinity_hits += 1
            else:
                self.counters.affinity_overridden += 1
            self._affinity.move_to_end(key)
        elif key is not None:
            self._remember(key, least)
        self.counters.routed += 1
        self.counters.per_replica[choice] += 1
        return choice

    def _remember(self, key: str, replica: int) -> None:
        self._affinity[key] = replica
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.max_prefixes:
            self._affinity.popitem(last=False)


def prefix_key(route: str, body: Mapping[str, Any], chars: int = PREFIX_CHARS) -> str | None:
    """The prefix key of an OpenAI request body (None when it has no prompt to speak of).

    chat: the leading system (or developer) messages when there are any, so requests sharing a
    system prompt share a key however short it is; else the messages' roles and contents in
    order (a continued conversation keeps its key); either as one string, cut at `chars`;
    responses: as chat, `instructions` being the system message and a string `input` the user's;
    completions: the prompt (text, or token ids as text), or the first prompt of a list, cut at
    `chars`.  Rendering is not the chat template's, only stable: equal prefixes, equal keys.
    """
    if route.endswith("chat/completions"):
        text = _messages_text(body.get("messages"))
    elif route.endswith("/responses"):
        text = _messages_text(_responses_messages(body))
    else:
        text = _prompt_text(body.get("prompt"))
    if not text:
        return None
    return hashlib.blake2b(text[:chars].encode("utf-8", "replace"), digest_size=16).hexdigest()


def _responses_messages(body: Mapping[str, Any]) -> list:
    """A Responses API body's turns as chat messages, enough for a key: `instructions` as the system
    message, a string `input` as the user's, listed items as they are."""
    instructions, given = body.get("instructions"), body.get("input")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    turns = [{"role": "user", "content": given}] if isinstance(given, str) else given if isinstance(given, list) else []
    return system + turns


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    messages = [m for m in messages if isinstance(m, Mapping)]
    leading = 0
    while leading < len(messages) and messages[leading].get("role") in ("system", "developer"):
        leading += 1
    parts = []
    for message in messages[: leading or len(messages)]:
        content = message.get("content")
        content = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
        parts.append(f"<{message.get('role')}>{content}")
    return "".join(parts)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return " ".join(map(str, prompt))  # token ids: the same prefix cut, in characters
        return _prompt_text(prompt[0])  # a batch of prompts goes to one replica: key of the first
    return ""
