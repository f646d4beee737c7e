"""The tensor-parallel rank protocol without pickle: step messages round-trip through
graphexec/parallel/step_codec.py for every batch the scheduler makes (generated, and captured
from a tiny engine), hostile bytes are refused with StepMessageError (a worker's receive turns
that into WorkerFailedError) and never executed, and a worker's config arrives as checked JSON.
No process group: the transport is tests/test_tp_engine.py's."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphexec import Engine, SamplingParams
from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.prompt_logprobs import PromptLogprobPlan, PromptLogprobSpan
from graphexec.cache.req_to_token_pool import ReqToTokenPool
from graphexec.config import EngineConfig
from graphexec.errors import ConfigError, WorkerFailedError
from graphexec.parallel import launch, step_schema, step_sync
from graphexec.parallel.step_codec import decode, encode
from graphexec.parallel.step_schema import HEADER_BYTES, StepKind, StepMessage, StepMessageError
from graphexec.structured.spec import StructuredSpec

ROOT = Path(__file__).resolve().parent.parent
_FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
_WORDS = {name: i for i, name in enumerate(step_schema.SCALARS)}


# -- generated messages: every layout ForwardBatch.init_new (and padding) makes ----------------


def _ints(draw, n: int, hi: int = 5000, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(draw(st.lists(st.integers(0, hi), min_size=n, max_size=n)), dtype=dtype)


@st.composite
def _plans(draw, prefix: list[int], extend: list[int]) -> PromptLogprobPlan | None:
    spans, start = [], 0
    for i, (p, e) in enumerate(zip(prefix, extend)):
        if e and draw(st.booleans()):
            spans.append(PromptLogprobSpan(i, start, draw(st.integers(1, e)), p + 1, draw(st.integers(0, 20))))
        start += e
    if not spans:
        return None
    rows = torch.tensor([r for s in spans for r in range(s.first_row, s.first_row + s.num_rows)])
    return PromptLogprobPlan(tuple(spans), rows, _ints(draw, len(rows)), max(s.top_k for s in spans))


@st.composite
def _batches(draw) -> ForwardBatch:
    mode = draw(st.sampled_from(list(ForwardMode)))
    n = draw(st.integers(0, 5))
    prefix = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    extend = draw(st.lists(st.integers(1, 7), min_size=n, max_size=n)) if mode.is_extend() else [1] * n
    seq = [p + e for p, e in zip(prefix, extend)]
    # A padded batch (capture/padding.py) has rows past the real ones and the real count on the device.
    real, pad = sum(extend), draw(st.integers(0, 3))
    padded = pad > 0 or draw(st.booleans())
    fields = dict(_NO_EXTEND)
    if mode.is_extend():
        starts = [sum(extend[:i]) for i in range(n)]
        fields = dict(
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int64),
            extend_seq_lens=torch.tensor(extend, dtype=torch.int64),
            extend_start_loc=torch.tensor(starts, dtype=torch.int64),
            extend_prefix_lens_cpu=tuple(prefix),
            extend_seq_lens_cpu=tuple(extend),
            extend_num_tokens=real,
            prompt_logprobs=draw(_plans(prefix, extend)),
        )
    return ForwardBatch(
        forward_mode=mode,
        batch_size=n,
        input_ids=_ints(draw, real + pad),
        positions=_ints(draw, real + pad, hi=64),
        req_pool_indices=_ints(draw, n, hi=8),
        seq_lens=torch.tensor(seq, dtype=torch.int64),
        seq_lens_cpu=tuple(seq),
        seq_lens_sum=sum(seq),
        # int32 exercises another dtype code and the zero padding of an odd-length slot.
        out_cache_loc=_ints(draw, real + pad, dtype=draw(st.sampled_from([torch.int64, torch.int32]))),
        num_token_non_padded=real,
        sampling_info=None,
        num_token_non_padded_device=torch.tensor([real]) if padded else None,
        **fields,
    )


_NO_EXTEND = dict(
    extend_prefix_lens=None, extend_seq_lens=None, extend_start_loc=None,
    extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None, extend_num_tokens=None,
)  # fmt: skip

_slots = st.integers(0, 30).flatmap(lambda k: st.lists(st.integers(0, 10**6), min_size=k, max_size=k)).map(torch.tensor)
_points = st.integers(0, 8).flatmap(
    lambda k: st.tuples(
        st.just("points"),
        st.lists(st.integers(0, 64), min_size=k, max_size=k),
        st.lists(st.integers(0, 4096), min_size=k, max_size=k),
        st.lists(st.integers(0, 10**6), min_size=k, max_size=k).map(lambda v: torch.tensor(v, dtype=torch.int64)),
    )
)
_changes = st.lists(
    st.one_of(
        st.tuples(st.just("span"), st.integers(0, 64), st.integers(0, 4096), _slots.map(lambda t: t.to(torch.int64))),
        _points,
        st.tuples(st.just("clear"), st.integers(0, 64)),
    ),
    max_size=6,
).map(tuple)


@st.composite
def _messages(draw) -> StepMessage:
    kind = draw(st.sampled_from(list(StepKind)))
    batch = draw(_batches()) if kind is StepKind.FORWARD else None
    return StepMessage(kind, batch, draw(_changes))


def _same_tensor(a, b) -> bool:
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_same_message(got: StepMessage, want: StepMessage) -> None:
    assert got.kind is want.kind
    assert (got.batch is None) == (want.batch is None)
    if want.batch is not None:
        for f in dataclasses.fields(ForwardBatch):
            a, b = getattr(got.batch, f.name), getattr(want.batch, f.name)
            if isinstance(b, torch.Tensor):
                assert _same_tensor(a, b), f.name
            elif isinstance(b, PromptLogprobPlan):
                assert a.spans == b.spans and a.max_top_k == b.max_top_k
                assert _same_tensor(a.rows, b.rows) and _same_tensor(a.targets, b.targets)
            else:
                assert a == b and type(a) is type(b), f.name
    assert len(got.table_changes) == len(want.table_changes)
    for a, b in zip(got.table_changes, want.table_changes):
        assert a[0] == b[0] and len(a) == len(b)
        for x, y in zip(a[1:], b[1:]):
            assert torch.equal(x, y) if isinstance(y, torch.Tensor) else list(x) == list(y) if isinstance(y, list) else x == y


@_FAST
@given(_messages())
def test_every_message_round_trips(message):
    data = encode(message)
    assert len(data) % 8 == 0
    assert_same_message(decode(data), message)


def test_codec_knows_every_forward_batch_field():
    assert {f.name for f in dataclasses.fields(ForwardBatch)} == step_schema.BATCH_FIELDS
    assert set(step_schema.MODES) == set(ForwardMode) and set(step_schema.KINDS) == set(StepKind)

    @dataclasses.dataclass(frozen=True)
    class Grown(ForwardBatch):
        draft_tokens: torch.Tensor | None = None

    grown = Grown(**{f.name: getattr(_decode_batch(), f.name) for f in dataclasses.fields(ForwardBatch)})
    with pytest.raises(StepMessageError, match="draft_tokens"):
        encode(StepMessage(StepKind.FORWARD, grown))


def test_sampling_state_never_travels():
    fb = dataclasses.replace(_decode_batch(), sampling_info=object())
    with pytest.raises(StepMessageError, match="sampling_info"):
        encode(StepMessage(StepKind.FORWARD, fb))


def test_batches_of_a_real_engine_round_trip():
    """Chunked prefill, MIXED batches, prompt logprobs, decode: what the scheduler really sends,
    with the table journal; the decoded journal rebuilds rank 0's table."""
    overrides = ["model=tiny-llama", "capture=eager", "cache.num_slots=2048", "scheduler.max_prefill_tokens=16",
                 "scheduler.mixed_chunk=true"]  # fmt: skip
    seen, engine = set(), Engine(overrides=overrides)
    table = engine.kv_cache.req_to_token_pool
    table._journal = []  # as on rank 0 of a tensor-parallel group
    mirror = ReqToTokenPool(table.max_requests, table.max_context)

    class Recorder:  # stands in for StepSender: round-trips what it would send
        keep_alive_s = None

        @contextlib.contextmanager
        def step(self, fb, changes):
            self.check(StepMessage(StepKind.FORWARD, dataclasses.replace(fb, sampling_info=None), tuple(changes)))
            seen.add((fb.forward_mode, fb.prompt_logprobs is not None))
            yield

        def keep_alive(self, changes):
            self.check(StepMessage(StepKind.KEEP_ALIVE, table_changes=tuple(changes)))

        def check(self, message):
            got = decode(encode(message))
            assert_same_message(got, message)
            mirror.replay(list(got.table_changes))

    engine.runner.channel = Recorder()
    try:
        prompts = ["hello world " * 5, "abc", "the quick brown fox jumps over the lazy dog " * 3]
        params = [SamplingParams(max_new_tokens=6, prompt_logprobs=2), SamplingParams(max_new_tokens=12),
                  SamplingParams(max_new_tokens=4, prompt_logprobs=0)]  # fmt: skip
        engine.generate(prompts, params)
    finally:
        engine.shutdown()
    engine.runner.keep_alive()  # the journal since the last step (the finished requests' rows), loop stopped
    assert {(ForwardMode.EXTEND, True), (ForwardMode.MIXED, True), (ForwardMode.DECODE, False)} <= seen
    assert torch.equal(mirror.req_to_token, table.req_to_token)


# -- hostile bytes -----------------------------------------------------------------------------


def _decode_batch(n: int = 2) -> ForwardBatch:
    seq = tuple(range(5, 5 + n))
    t = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=n, input_ids=t(range(n)), positions=t([s - 1 for s in seq]),
        req_pool_indices=t(range(1, n + 1)), seq_lens=t(seq), seq_lens_cpu=seq, seq_lens_sum=sum(seq),
        out_cache_loc=t(range(10, 10 + n)), num_token_non_padded=n, sampling_info=None, **_NO_EXTEND,
    )  # fmt: skip


def _valid() -> bytes:
    changes = (("points", [1, 2], [4, 5], torch.tensor([10, 11])), ("span", 3, 0, torch.arange(4)), ("clear", 4))
    return encode(StepMessage(StepKind.FORWARD, _decode_batch(), changes))


def _with_word(data: bytes, index: int, value: int) -> bytes:
    return data[: 8 * index] + value.to_bytes(8, "little", signed=True) + data[8 * index + 8 :]


def _slot_word(name: str, rows: bool) -> int:
    i = [s.name for s in step_schema.SLOTS].index(name)
    return len(step_schema.SCALARS) + 2 * i + int(rows)


def _one_input_id_fewer(data: bytes) -> bytes:
    """A header and body that agree with each other on a 1-token input_ids, and nothing else does."""
    data = _with_word(data, _slot_word("input_ids", True), 1)
    data = data[:HEADER_BYTES] + data[HEADER_BYTES + 8 :]
    return _with_word(data, _WORDS["total_bytes"], len(data))


class _Exploit:
    """What an attacker would send to a rank that unpickles: a shell command at load time."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@_FAST
@given(st.binary(max_size=2 * HEADER_BYTES))
def test_random_bytes_are_refused(data):
    with pytest.raises(StepMessageError):
        decode(data)


@_FAST
@given(
    _messages(),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(-3, 80) | st.integers(-(2**63), 2**63 - 1)), max_size=3),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
)
def test_corrupt_messages_are_refused_or_harmless(message, word_edits, byte_edits):
    """Any header word set to anything, any byte anywhere: a StepMessageError, or (what the schema
    allows) a message; never another exception."""
    data = encode(message)
    for index, value in word_edits:
        data = _with_word(data, index % step_schema.HEADER_WORDS, value)
    for index, value in byte_edits:
        data = data[: index % len(data)] + bytes([value]) + data[index % len(data) + 1 :]
    try:
        decode(data)
    except StepMessageError:
        pass


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d[:-8], "total_bytes"),
        (lambda d: d[: HEADER_BYTES - 8], "truncated inside its"),
        (lambda d: d[:12], "shorter than"),
        (lambda d: _with_word(d + bytes(8), _WORDS["total_bytes"], len(d) + 8), "trailing bytes"),
        (lambda d: _with_word(d, 0, 0x1234), "bad magic"),
        (lambda d: _with_word(d, _WORDS["version"], 99), "version 99"),
        (lambda d: _with_word(d, _WORDS["kind"], 3), "kind code 3"),
        (lambda d: _with_word(d, _WORDS["kind"], -1), "kind code -1"),
        (lambda d: _with_word(d, _WORDS["forward_mode"], 5), "forward_mode code 5"),
        (lambda d: _with_word(d, _WORDS["flags"], 1 | 64), "flags"),
        (lambda d: _with_word(d, _WORDS["flags"], 1 | 2), "takes no extend fields"),
        (lambda d: _with_word(d, _WORDS["batch_size"], 3), "batch_size=3"),
        (lambda d: _with_word(d, _WORDS["num_tokens"], -2), "num_tokens=-2 is negative"),
        (lambda d: _with_word(d, _WORDS["seq_lens_sum"], 1), "seq_lens_sum=1"),
        (lambda d: _with_word(d, _slot_word("input_ids", True), 3), "run past the message"),
        (lambda d: _with_word(d, _slot_word("input_ids", True), 1), "8 trailing bytes"),
        (_one_input_id_fewer, "input_ids has 1 rows, header num_tokens=2"),
        (lambda d: _with_word(d, _slot_word("input_ids", True), 2**62), "4611686018427387904 rows is not a length"),
        (lambda d: _with_word(d, _slot_word("input_ids", True), -1), "-1 rows is not a length"),
        (lambda d: _with_word(d, _slot_word("positions", False), 6), "dtype code 6"),
        (lambda d: _with_word(d, _slot_word("positions", False), 0), "positions is missing"),
        (lambda d: _with_word(d, _slot_word("num_token_non_padded_device", False), 1), "present but its flag"),
        (lambda d: _with_word(d, _WORDS["num_changes"], 2), "change_heads has 3 rows, header num_changes=2"),
    ],
)
def test_malformed_messages_name_what_is_wrong(edit, match):
    with pytest.raises(StepMessageError, match=match):
        decode(edit(_valid()))


def test_every_truncation_is_refused():
    data = _valid()
    for n in range(len(data)):
        with pytest.raises(StepMessageError):
            decode(data[:n])


@pytest.mark.parametrize(
    "changes, match",
    [
        ([[7, 1, 0, 0]], "kind code 7"),
        ([[0, -1, 0, 0]], "row -1"),
        ([[2, 1, 0, 4]], "a clear change"),
        ([[0, 1, 0, 3]], "use 3 slots"),
    ],
)
def test_malformed_table_changes_are_refused(changes, match):
    data = encode(StepMessage(StepKind.KEEP_ALIVE))  # a header and four empty change slots
    data += torch.tensor(changes, dtype=torch.int64).numpy().tobytes()
    for word, value in ((_WORDS["num_changes"], len(changes)), (_slot_word("change_heads", True), len(changes)),
                        (_WORDS["total_bytes"], len(data))):  # fmt: skip
        data = _with_word(data, word, value)
    with pytest.raises(StepMessageError, match=match):
        decode(data)


def test_a_pickle_payload_is_refused_and_never_run(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker))
    with pytest.raises(StepMessageError, match="bad magic"):
        decode(payload)
    # Framed as rank 0 would frame a message, through a worker's receive.
    frame = bytearray(step_sync._BUFFER_BYTES)
    frame[:8] = len(payload).to_bytes(8, "little")
    frame[8 : 8 + len(payload)] = payload
    _broadcasts(monkeypatch, [torch.frombuffer(frame, dtype=torch.uint8)])
    with pytest.raises(WorkerFailedError, match="malformed step message"):
        step_sync.receive(None)
    assert not marker.exists()
    pickle.loads(payload)  # the same bytes, unpickled: the attack was real
    assert marker.exists()


# -- framing: StepSender and receive over a recorded broadcast -------------------------------


def _broadcasts(monkeypatch, replay: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Record what the sender broadcasts, or (replay) fill the receiver's buffers with it."""
    sent: list[torch.Tensor] = []
    chunks = iter(replay or [])

    def broadcast(tensor, src, group):
        if replay is None:
            sent.append(tensor.clone())
        else:
            tensor.copy_(next(chunks))

    monkeypatch.setattr(step_sync.dist, "broadcast", broadcast)
    return sent


@pytest.mark.parametrize("slots", [4, 20_000])  # 20,000 int64 slots: past the one-broadcast buffer
def test_sender_and_receiver_agree_on_the_frame(monkeypatch, slots):
    message = StepMessage(StepKind.KEEP_ALIVE, table_changes=(("span", 1, 0, torch.arange(slots)),))
    sent = _broadcasts(monkeypatch)
    step_sync.StepSender(None, 2, keep_alive_s=60.0)._send(message)
    assert len(sent) == (1 if slots < 1000 else 2) and sent[0].numel() == step_sync._BUFFER_BYTES
    _broadcasts(monkeypatch, sent)
    assert_same_message(step_sync.receive(None), message)


@pytest.mark.parametrize("length", [0, 2**40, 2**63 - 1])
def test_receive_refuses_an_impossible_length(monkeypatch, length):
    frame = torch.zeros(step_sync._BUFFER_BYTES, dtype=torch.uint8)
    frame[:8] = torch.frombuffer(bytearray(length.to_bytes(8, "little")), dtype=torch.uint8)
    _broadcasts(monkeypatch, [frame])
    with pytest.raises(WorkerFailedError, match=f"length {length}"):
        step_sync.receive(None)


def test_no_rank_code_unpickles():
    """Anything that turns received bytes into objects (pickle, torch.load, torch.distributed's
    *_object collectives, which pickle) stays out of the rank protocol."""
    forbidden = re.compile(
        r"^\s*(import pickle|from pickle import)|pickle\.loads?\b|torch\.load\b|"
        r"(broadcast|scatter)_object_list|all_gather_object|gather_object|recv_object_list",
        re.MULTILINE,
    )
    files = [*sorted((ROOT / "graphexec" / "parallel").glob("*.py")), ROOT / "graphexec" / "engine" / "tp_worker.py"]
    found = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in files for m in forbidden.finditer(p.read_text())]
    assert found == []


# -- the config a local worker gets on stdin ---------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=tiny-llama", "capture=eager", "parallel.tp_size=2", "parallel.threads_per_rank=1"],
        ["model=smollm2-135m", "capture=auto", "cache.dtype=bf16", "scheduler.admission=reserve"],
        ["model=smollm2-135m-random", "capture=graph_first", "sampling=creative", "sampling.logit_bias={5: 1.5}"],
    ],
)
def test_worker_config_arrives_as_checked_json(overrides):
    config = EngineConfig.from_overrides(overrides)
    data = launch._dump_config(config)
    json.loads(data)  # plain JSON, nothing else
    assert launch.load_config(io.BytesIO(data)) == config


def test_worker_config_is_checked_like_a_composed_one():
    plain = EngineConfig.from_overrides(["model=tiny-llama", "capture=eager"]).to_plain()
    plain["scheduler"]["max_running_requests"] = 0
    with pytest.raises(ConfigError, match="scheduler.max_running_requests"):
        launch.load_config(io.BytesIO(json.dumps(plain).encode()))


def test_worker_config_refuses_pickle(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(ConfigError, match="not the JSON config"):
        launch.load_config(io.BytesIO(pickle.dumps(_Exploit(marker))))
    assert not marker.exists()


def test_a_config_that_is_not_plain_data_fails_at_rank_0():
    config = EngineConfig.from_overrides(["model=tiny-llama", "capture=eager"])
    config = dataclasses.replace(config, sampling=config.sampling.replace(structured=StructuredSpec("json_object")))
    with pytest.raises(ConfigError, match="sampling.structured"):
        launch._dump_config(config)
