"""Property tests for posttrain.core.data: whatever a JSONL file holds (random JSON values, near-valid rows with
wrong types and roles, huge strings, unicode edge cases, invalid bytes, empty files), loading ends
in data, a counted skip, or a DataError naming the file, a real line and the field; never any other
exception. Plus packing and sampling invariants over random lengths."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from tests.support.data_fixtures import data_config, make_tokenizer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from posttrain.core.data import REASONS, BatchSampler, DataError, load_data, pack

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOK = make_tokenizer()
# Rejections about a whole row; every other reason is about one field and must name it.
ROW_LEVEL = {"invalid_json", "invalid_unicode", "not_an_object", "unknown_format", "duplicate"}

EDGE_TEXT = st.sampled_from([
    "", " ", "\n", "\x00", "\ud800", "\udfff", "a\u200db", "\u202eevil", "e\u0301", "🤖" * 3, "\uffff",
    "<|im_end|>", "<|im_start|>assistant\n", "{{ raise_exception('x') }}", "x" * 20_000, "two plus four " * 300,
])
WORDS = st.lists(st.sampled_from("what is two plus four blue red 🤖 café".split()), min_size=1, max_size=8)
WORDS = WORDS.map(" ".join)
CLEAN = st.one_of(WORDS, WORDS, st.text(min_size=1, max_size=30).filter(str.strip))  # valid content
TEXT = st.one_of(CLEAN, EDGE_TEXT)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
ROLE = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), st.sampled_from(["bot", "", "USER"]), JSON)


@st.composite
def message(draw):
    msg = {}
    if draw(st.integers(0, 9)):
        msg["role"] = draw(ROLE)
    if draw(st.integers(0, 9)):
        msg["content"] = draw(st.one_of(TEXT, TEXT, JSON))
    if draw(st.booleans()):
        msg[draw(st.sampled_from(["name", "tool_calls", "extra"]))] = draw(JSON)
    return msg


def alternating(draw, corrupt: bool):
    """A well-formed conversation; when `corrupt`, some turns are replaced by random messages."""
    n = draw(st.integers(1, 4)) * 2
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": draw(CLEAN)} for i in range(n)]
    for i in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2)) if corrupt else []:
        msgs[i] = draw(message())
    return msgs


@st.composite
def row(draw, kind: int):
    """A row of the file's format `kind` (0-3), corrupted now and then, or garbage."""
    noise = draw(st.integers(0, 9))  # hypothesis favours 0 and shrinks towards it: 0 = a clean row
    if noise == 9:
        return json.dumps(draw(JSON))
    if noise == 8:  # raw text or bytes, usually not JSON
        return draw(st.one_of(st.text(max_size=30), st.binary(max_size=30)))
    corrupt = noise >= 5
    if kind == 0:
        value = {"messages": alternating(draw, corrupt)}
    elif kind == 1:
        value = {"prompt": draw(CLEAN), "completion": draw(CLEAN)}
        if draw(st.booleans()):
            value = {"prompt": alternating(draw, corrupt)[:1],
                     "completion": [{"role": "assistant", "content": draw(CLEAN)}]}
    elif kind == 2:
        value = {"prompt": draw(CLEAN), "chosen": draw(CLEAN), "rejected": draw(CLEAN)}
    else:
        convo = alternating(draw, corrupt)
        value = {"chosen": convo, "rejected": convo[:-1] + [{"role": "assistant", "content": draw(CLEAN)}]}
    if corrupt and draw(st.booleans()):  # drop, retype or fill with edge-case text one field
        key = draw(st.sampled_from(sorted(value)))
        how = draw(st.integers(0, 2))
        value.pop(key) if how == 0 else value.__setitem__(key, draw(JSON if how == 1 else EDGE_TEXT))
    # ensure_ascii=True escapes lone surrogates ("\ud800"), as other writers do; the reader must cope
    return json.dumps(value, ensure_ascii=draw(st.booleans()) or _has_surrogate(value))


def _has_surrogate(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _write(path: Path, rows: list) -> list[bytes]:
    """Write rows (str as UTF-8, bytes verbatim), one per line; return the lines as the reader sees them."""
    data = b"".join((r if isinstance(r, bytes) else r.encode("utf-8", "surrogatepass")) + b"\n" for r in rows)
    path.write_bytes(data)
    lines = data.split(b"\n")[:-1]
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):
        lines[0] = lines[0][3:]
    return [line.rstrip(b"\r") for line in lines]


def _check_error(err: DataError, path: Path, lines: list[bytes]) -> None:
    text = str(err)
    assert str(path) in text, text
    if err.row is None:
        assert err.reason == "source" and "no usable rows" in text, text
        return
    assert err.reason in REASONS and f"line {err.row}" in text, text
    assert 1 <= err.row <= len(lines) and lines[err.row - 1].strip(), (err.row, len(lines))
    if err.reason not in ROW_LEVEL and "nested too deeply" not in text:
        assert err.field is not None, text
    if err.field is not None:
        assert f", field {err.field}: " in text, text
    assert len(text) < 2000  # huge values are shortened in messages


@st.composite
def jsonl_file(draw):
    """Rows of one format (TRL datasets are homogeneous), and data.format: auto, right or wrong."""
    kind = draw(st.integers(0, 3))
    task = "sft" if kind < 2 else "preference"
    fmt = draw(st.sampled_from(["auto", "auto", "auto", task, "preference" if task == "sft" else "sft"]))
    return draw(st.lists(row(kind), min_size=1, max_size=8)), fmt  # empty files: test_data.py


@SETTINGS
@given(file=jsonl_file(), truncation=st.sampled_from(["right", "left", "drop"]),
       max_seq_len=st.sampled_from([40, 128, 512]))
def test_any_jsonl_loads_or_fails_with_a_located_data_error(file, truncation, max_seq_len):
    rows, fmt = file
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.jsonl"
        lines = _write(path, rows)
        n_rows = sum(1 for line in lines if line.strip())
        cfg = dict(format=fmt, truncation=truncation, max_seq_len=max_seq_len)
        raised = None
        try:
            strict = load_data(data_config([path], **cfg), TOK)
        except DataError as e:
            _check_error(e, path, lines)
            raised = e
        try:
            lenient = load_data(data_config([path], on_bad_row="skip", **cfg), TOK)
        except DataError as e:
            _check_error(e, path, lines)
            assert e.row is None and f"kept 0, dropped {n_rows}" in str(e), str(e)
            event("skip: no usable rows")
            return
        stats = lenient.stats
        for reason in stats.dropped:
            event(f"skipped: {reason}")
        event(f"strict: {raised.reason if raised else 'loaded'}")
        assert stats.kept + stats.total_dropped == n_rows
        assert stats.kept == sum(len(v) for v in lenient.splits.values())
        if raised is None:  # strict mode dropped only what the config drops anyway
            assert set(stats.dropped) <= {"too_long"} and strict.stats.kept == stats.kept
        elif raised.row is not None:
            assert stats.dropped[raised.reason] >= 1


@SETTINGS
@given(lengths=st.lists(st.integers(1, 64), max_size=60), capacity=st.integers(64, 130))
def test_packing_places_every_document_once_within_capacity(lengths, capacity):
    for strategy in ("ffd", "greedy"):
        rows = pack(lengths, capacity, strategy)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(r and sum(lengths[i] for i in r) <= capacity for r in rows)
        assert len(rows) >= math.ceil(sum(lengths) / capacity)
    greedy = pack(lengths, capacity, "greedy")
    assert [i for r in greedy for i in r] == list(range(len(lengths)))  # data order kept
    assert all(sum(lengths[i] for i in a) + lengths[b[0]] > capacity for a, b in zip(greedy, greedy[1:]))
    # first-fit decreasing, the slow obvious way
    ref: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((r for r in ref if sum(lengths[j] for j in r) + lengths[i] <= capacity), None)
        fit.append(i) if fit is not None else ref.append([i])
    assert pack(lengths, capacity, "ffd") == ref


@SETTINGS
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=50), world_size=st.integers(1, 4),
       tokens=st.one_of(st.none(), st.integers(50, 300)), seed=st.integers(0, 3), data=st.data())
def test_sampling_is_sharded_once_and_resumable(lengths, world_size, tokens, seed, data):
    budget = {"batch_tokens": tokens} if tokens else {"micro_batch_size": 3}
    every = BatchSampler(lengths, seed=seed, **budget).global_batches(0)
    shards = [list(BatchSampler(lengths, rank=r, world_size=world_size, seed=seed, drop_last=False, **budget))
              for r in range(world_size)]
    assert sorted(b for s in shards for b in s) == sorted(every)
    rank = data.draw(st.integers(0, world_size - 1))
    make = lambda: BatchSampler(lengths, rank=rank, world_size=world_size, seed=seed, num_epochs=2, **budget)
    full = list(make())
    k = data.draw(st.integers(0, len(full)))
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(k)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + list(resumed) == full


# ------------------------------------------------------------------------------ Parquet

# Parquet columns are typed: a bad row is a null, a wrong role or an empty string inside a
# well-typed column, or a whole column of the wrong type. Arrow unifies the rows' types; rows it
# cannot unify cannot be written, so each column draws all its values from one typed strategy.
P_TEXT = st.one_of(CLEAN, EDGE_TEXT.filter(lambda s: not _has_surrogate(s)))
P_ROLE = st.sampled_from(["system", "user", "assistant", "tool", "bot", "", "USER"])
P_MESSAGE = st.fixed_dictionaries({"role": st.one_of(P_ROLE, st.none()), "content": st.one_of(P_TEXT, st.none())})
P_CONVO = st.lists(P_MESSAGE, max_size=4)
P_COLUMNS = {  # column -> strategies of one Arrow type each, right or wrong
    "messages": [P_CONVO, st.lists(P_TEXT, max_size=3), st.integers(), P_TEXT],
    "prompt": [P_TEXT, P_CONVO, st.integers()],
    "completion": [P_TEXT, P_CONVO, st.floats(allow_nan=True)],
    "chosen": [P_TEXT, P_CONVO, st.booleans()],
    "rejected": [P_TEXT, P_CONVO],
    "extra": [st.integers(), P_TEXT],
}


@st.composite
def parquet_rows(draw):
    names = draw(st.sampled_from([["messages"], ["prompt", "completion"], ["prompt", "chosen", "rejected"],
                                  ["chosen", "rejected"], ["messages", "extra"], ["extra"]]))
    typed = {n: draw(st.sampled_from(P_COLUMNS[n][:1] * 3 + P_COLUMNS[n][1:])) for n in names}
    n_rows = draw(st.integers(1, 6))
    rows = []
    for _ in range(n_rows):
        row = {}
        for n, strategy in typed.items():
            row[n] = draw(st.one_of(strategy, strategy, strategy, st.none()))  # nulls now and then
        if typed.get("messages") is P_CONVO and draw(st.booleans()):  # often a well-formed conversation
            row["messages"] = alternating(draw, corrupt=draw(st.booleans()))
        rows.append(row)
    return rows


@SETTINGS
@given(rows=parquet_rows(), fmt=st.sampled_from(["auto", "auto", "sft", "preference"]))
def test_any_parquet_loads_or_fails_with_a_located_data_error(rows, fmt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.parquet"
        try:  # rows no Parquet file can hold (mixed types, lone surrogates, empty structs) are no input
            pq.write_table(pa.Table.from_pylist(rows), path)
        except (pa.ArrowException, OverflowError, UnicodeEncodeError):
            event("not writable as Parquet")
            return
        for on_bad_row in ("error", "skip"):
            try:
                data = load_data(data_config([path], format=fmt, on_bad_row=on_bad_row), TOK)
            except DataError as e:
                text = str(e)
                assert str(path) in text and len(text) < 2000, text
                if e.row is not None:
                    assert e.unit == "row" and 0 <= e.row < len(rows) and f"row {e.row}" in text, text
                    if e.reason not in ROW_LEVEL:
                        assert e.field is not None and f", field {e.field}: " in text, text
                else:
                    assert e.reason == "source", text
                event(f"{on_bad_row}: {e.reason}")
                continue
            stats = data.stats
            assert stats.kept + stats.total_dropped == len(rows)
            event(f"{on_bad_row}: kept {stats.kept}/{len(rows)}")
