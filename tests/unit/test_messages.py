"""The typed wire messages of ``_messages``, tested with bytes alone (no sockets).

Every message goes through the real framer (``encode`` -> bytes -> ``Decoder``) and back:
``decode(encode(x)) == x``; the bytes are those the wire carried before the messages were
typed (the old encoders are spelled out here); a malformed field is a ``ProtocolError`` from
``decode`` and nothing else."""

from __future__ import annotations

import contextlib
import dataclasses
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmdd_async._enums import DataType, LLMStatusCode
from llmdd_async._errors import ProtocolError
from llmdd_async._messages import (
    FLAG_EAGER,
    FLAG_TO_INITIATOR,
    MAX_REASON,
    Abort,
    Address,
    By,
    Bye,
    CacheInfo,
    Cap,
    Challenge,
    Data,
    Done,
    Grant,
    Hello,
    Host,
    Identity,
    LinkRefused,
    Mode,
    MooncakeInfo,
    NixlInfo,
    Op,
    Ping,
    Pong,
    Proof,
    Prove,
    ProveAck,
    ProveFin,
    Request,
    Result,
    Shape,
    Table,
    TableRequest,
    TableSnapshot,
    Unlink,
    UnlinkAck,
    regions_of,
    wire_status,
)
from llmdd_async._protocol import MT, NEED_DATA, PROTOCOL_VERSION, Decoder, Message, encode

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(0, 1 << 20)
words = st.text(max_size=12)
statuses = st.sampled_from(list(LLMStatusCode))


def wire(msg: Message) -> Message:
    """``msg`` as the peer's decoder hands it out (through the bytes)."""
    d = Decoder()
    d.receive_data(encode(msg))
    out = d.next_event()
    assert isinstance(out, Message)
    if out.payload_len:
        d.payload_consumed(out.payload_len)
    assert d.next_event() is NEED_DATA
    return out


def arrays(min_size: int = 0, max_size: int = 6) -> st.SearchStrategy[np.ndarray]:
    return st.lists(u64, min_size=min_size, max_size=max_size).map(
        lambda v: np.array(v, dtype=np.uint64)
    )


def opt(s: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | s


ranges = st.builds(lambda a, b: range(a, b), i64, i64)
triples = st.tuples(small, small, st.booleans())


@st.composite
def addresses(draw: st.DrawFn) -> Address:
    by = draw(st.sampled_from(list(By)))
    if by in (By.REQ_KEY, By.PREFIX_KEY):
        return Address(by, id=draw(i64), model_id=draw(i64))
    if by is By.BLOCKS_KEY:
        return Address(by, model_id=draw(i64))
    if by is By.CACHE_ID:
        return Address(by, cache_id=draw(i64), index=draw(i64))
    return Address(by)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    target = draw(addresses())
    raw_addrs = draw(arrays(1)) if target.by is By.ADDRS else draw(opt(arrays()))
    return Request(
        draw(u64),
        draw(st.sampled_from(list(Op))),
        target,
        draw(st.sampled_from(list(Shape))),
        draw(triples),
        draw(arrays(1)),
        caps=draw(st.frozensets(st.sampled_from(list(Cap)))),
        dtype=draw(st.none() | st.sampled_from([int(t.value) for t in DataType])),
        timeout_ms=draw(st.integers(0, 2**40)),
        local_slot=draw(i64),
        size=draw(i64),
        src_offset=draw(i64),
        dst_offset=draw(i64),
        src_range=draw(opt(ranges)),
        dst_range=draw(opt(ranges)),
        tensor_num_per_layer=draw(i64),
        dst_block_bytes=draw(opt(i64)),
        src_blocks=draw(opt(arrays())),
        dst_blocks=draw(opt(arrays())),
        raw=draw(opt(triples)),
        raw_addrs=raw_addrs,
        eager=draw(opt(st.tuples(st.integers(1, 2**64 - 1), st.integers(-(2**63), 2**63 - 1)))),
    )


@st.composite
def grants(draw: st.DrawFn) -> Grant:
    if not draw(st.booleans()):
        status = draw(statuses.filter(lambda s: s != LLMStatusCode.LLM_SUCCESS))
        return Grant.refusal(draw(u64), status, draw(words))
    n = draw(st.integers(0, 5))
    mode = draw(st.sampled_from(list(Mode)))
    local = np.array(draw(st.lists(u64, min_size=n, max_size=n)), dtype=np.uint64)
    nbytes = np.array(draw(st.lists(u64, min_size=n, max_size=n)), dtype=np.uint64)
    remote = np.array(draw(st.lists(u64, min_size=n, max_size=n)), dtype=np.uint64)
    return Grant(
        draw(u64),
        mode=mode,
        total=draw(opt(u64)),
        done=draw(st.booleans()),
        local=local,
        nbytes=nbytes,
        remote=remote if mode is Mode.LOCAL else draw(opt(st.just(remote))),
    )


reasons = opt(st.text(max_size=MAX_REASON))
cache_infos = st.builds(
    CacheInfo,
    i64,
    st.lists(u64, max_size=4).map(tuple),
    small,
    small,
    st.booleans(),
    i64,
    st.booleans(),
)
tables = st.builds(
    Table,
    st.lists(cache_infos, max_size=4).map(tuple),
    st.dictionaries(st.text(max_size=4), i64, max_size=3),
    st.lists(st.tuples(words, i64, i64, i64, i64), max_size=3).map(tuple),
    opt(st.tuples(st.integers(1, 2**64 - 1), u64)),
    opt(st.dictionaries(st.text(max_size=4), st.text(max_size=8), max_size=3)),
)
hosts = st.builds(Host, opt(words), opt(words), opt(i64), opt(i64))
identities = st.builds(
    Identity,
    u64,
    opt(i64),
    st.booleans(),
    st.booleans(),
    opt(hosts),
    opt(words),
    opt(words),
    opt(words),
)
each_message = st.one_of(
    requests(),
    grants(),
    st.builds(Data, u64, u64, st.integers(0, 1 << 30), st.booleans()),
    st.builds(Done, u64, statuses, reasons),
    st.builds(Result, u64, statuses, reasons),
    st.builds(Abort, u64, statuses, reasons, st.booleans(), st.booleans()),
    st.sampled_from([TableRequest(), Ping(), Pong(), Unlink(), UnlinkAck(), Bye()]),
    tables,
    st.builds(Hello, words, i64),
    st.builds(Challenge, words, st.booleans()),
    identities,
    st.builds(LinkRefused, statuses, reasons, opt(i64), st.booleans()),
)


def decode_as(x: Any, msg: Message) -> Any:
    if isinstance(x, Identity):
        return Identity.decode(msg)
    return type(x).decode(msg)


# ---------------------------------------------------------------------------- round trips
@SETTINGS
@given(each_message)
def test_every_message_survives_the_bytes(x: Any) -> None:
    assert decode_as(x, wire(x.encode())) == x


@SETTINGS
@given(identities)
def test_a_successful_link_ack_is_the_identity_after_its_status(x: Identity) -> None:
    msg = wire(x.encode(MT.LINK_ACK))
    assert next(iter(msg.fields)) == "status"
    assert Identity.decode(msg) == x
    refusal = wire(LinkRefused(LLMStatusCode.LLM_LINK_FAILED).encode())
    with pytest.raises(ProtocolError):
        Identity.decode(refusal)


def test_the_vocabularies_are_the_wire_strings() -> None:
    assert [o.value for o in Op] == ["pull", "push"]
    assert [s.value for s in Shape] == ["slot", "blocks", "slot_to_blocks"]
    assert [m.value for m in Mode] == ["local", "stream"]
    assert [b.value for b in By] == ["req_key", "prefix_key", "blocks_key", "cache_id", "addrs"]
    assert [c.value for c in Cap] == ["inproc", "pools", "pvr", "nixl", "key_reads", "mooncake"]
    assert Op.PULL == "pull" and str(Shape.SLOT_TO_BLOCKS) == "slot_to_blocks"


# ---------------------------------------------------------------------------- the same bytes
def _old_request(r: Request) -> Message:
    """XFER_REQ as ``XferSpec.encode`` wrote it before the messages were typed."""
    tb, count, is_blocks = r.layout
    defaults: dict[str, Any] = {
        "local_slot": 0,
        "size": -1,
        "src_offset": 0,
        "dst_offset": 0,
        "src_range": None,
        "dst_range": None,
        "tnpl": 2,
        "dst_block_bytes": None,
    }

    def rng(x: range | None) -> list[int] | None:
        return None if x is None else [x.start, x.stop]

    caps = {"inproc": Cap.INPROC in r.caps, "pools": Cap.POOLS in r.caps}
    caps |= {"pvr": Cap.PVR in r.caps, "nixl": Cap.NIXL in r.caps}
    # What came since is added at the end, only when used: key_reads, mooncake, then dtype.
    caps |= {"key_reads": Cap.KEY_READS in r.caps, "mooncake": Cap.MOONCAKE in r.caps}
    fields: dict[str, Any] = {
        "op": str(r.op),
        "target": r.target.encode(),
        "shape": str(r.shape),
        "layout": [tb, count, is_blocks],
        "caps": {k: True for k, v in caps.items() if v is True},
        "timeout_ms": r.timeout_ms,
    }
    for name, value in (
        ("local_slot", r.local_slot),
        ("size", r.size),
        ("src_offset", r.src_offset),
        ("dst_offset", r.dst_offset),
        ("src_range", rng(r.src_range)),
        ("dst_range", rng(r.dst_range)),
        ("tnpl", r.tensor_num_per_layer),
        ("dst_block_bytes", r.dst_block_bytes),
    ):
        if value != defaults[name]:
            fields[name] = value
    if r.raw is not None:
        fields["raw"] = list(r.raw)
    if r.dtype is not None:
        fields["dtype"] = r.dtype
    if r.eager is not None:
        fields["eager"] = list(r.eager)
    arr: dict[str, bytes | memoryview] = {"local_addrs": r.local_addrs.astype("<u8").tobytes()}
    for name, a in (("src_blocks", r.src_blocks), ("dst_blocks", r.dst_blocks)):
        if a is not None:
            arr[name] = a.astype("<u8").tobytes()
    if r.raw_addrs is not None:
        arr["raw_addrs"] = r.raw_addrs.astype("<u8").tobytes()
    return Message(MT.XFER_REQ, r.req_id, fields, arr)


@SETTINGS
@given(requests())
def test_a_request_reads_the_same_packed_and_as_json(r: Request) -> None:
    msg = r.encode()
    if msg.packed is None:  # an integer outside int64: the JSON form, as it always was
        assert encode(msg) == encode(_old_request(r))
    assert Request.decode(wire(msg)) == r == Request.decode(wire(_old_request(r)))


@pytest.mark.parametrize(
    "make",
    [
        lambda v: v,
        lambda v: v[::2],  # strided
        lambda v: np.asfortranarray(v.reshape(2, -1)),  # 2-D, Fortran order
        lambda v: v.astype(">u8"),  # big-endian
        lambda v: v.astype(np.int64),
        lambda v: np.array(v[0]),  # 0-d
        lambda v: v[:0],  # empty
        lambda v: np.tile(v, 20),  # past the few copied
    ],
)
def test_u64_bytes_are_the_little_endian_values_in_c_order(make: Any) -> None:
    from llmdd_async._messages.fields import u64_bytes

    arr = make(np.array([1, 2**63, 3, 2**64 - 1, 5, 6], dtype=np.uint64))
    want = np.ascontiguousarray(arr).astype("<u8").tobytes()
    assert bytes(u64_bytes(arr)) == want


def _reshaped(a: np.ndarray | None, how: str) -> np.ndarray | None:
    if a is None or how == "as built":
        return a
    if how == "int64":  # (a caller's block list: numpy's default integers)
        return a.astype(np.int64)
    return np.tile(a, 70 // max(1, len(a)) + 1) if len(a) else a  # past the few copied


@SETTINGS
@given(
    x=requests() | grants(),
    how=st.sampled_from(["as built", "int64", "long"]),
    keyed=st.booleans(),
)
def test_a_typed_frame_is_the_encoders_frame(x: Request | Grant, how: str, keyed: bool) -> None:
    """``Request.frame`` and ``Grant.frame`` (no message object) give the generic encoder's
    bytes, tag and sequence included, whatever the arrays' dtype and length; the decoder reads
    them back as the same message."""
    from llmdd_async._protocol import FrameAuth

    names = ["local_addrs", "src_blocks", "dst_blocks", "raw_addrs"]
    if isinstance(x, Grant):
        names = ["local", "nbytes", "remote"]
    x = dataclasses.replace(x, **{n: _reshaped(getattr(x, n), how) for n in names})
    auths = [FrameAuth(b"k" * 32) if keyed else None for _ in range(2)]
    for _ in range(2):  # (the second frame's tag counts the first)
        assert x.frame(auths[0]) == encode(x.encode(), auths[1])
    dec = Decoder()
    if keyed:
        dec.set_auth(FrameAuth(b"k" * 32))
    dec.receive_data(x.frame(None if not keyed else FrameAuth(b"k" * 32)))
    got = dec.next_event()
    assert isinstance(got, Message)
    want = dataclasses.replace(
        x, **{n: None if getattr(x, n) is None else getattr(x, n).astype(np.uint64) for n in names}
    )
    assert type(x).decode(got) == want


def test_a_packed_request_is_the_bytes_of_wire_version_3() -> None:
    r = Request.decode(_valid_request())
    r = dataclasses.replace(
        r,
        caps=frozenset({Cap.PVR, Cap.MOONCAKE}),
        dtype=4,
        src_range=range(1, 3),
        eager=(4096, -5),
    )
    ints = [0, 0, 1, 0, 64, 8, 0, 0, -1, 0, 0, 1, 3, 0, 0, 2, 0, 0, 0, 4, 4096, -5]
    # pull, blocks, by cache id; src_range, dtype, a blocks layout, eager (version 3: its
    # total and digest last); caps pvr and mooncake
    fields = struct.pack("<BBBBH22q", 0, 1, 3, 0b10110001, 0b100100, *ints)
    sizes = struct.pack("<4I", 8, 8, 8, 0xFFFFFFFF)
    arrays = struct.pack("<3Q", 4096, 2, 1)
    meta = struct.pack("<I", len(fields) | 1 << 31) + fields + sizes + arrays
    head = struct.pack("<IHHQIIQ", 0x3144444C, 3, 10, 1, len(meta), 0, 0)
    assert encode(r.encode()) == head + meta
    assert Request.decode(wire(r.encode())).eager == (4096, -5)


def test_an_eager_data_frame_says_so_in_its_flags() -> None:
    msg = Data(5, 0, 16, eager=True).encode()
    assert msg.flags == FLAG_EAGER
    assert Data.decode(wire(msg)) == Data(5, 0, 16, False, True)
    assert Data.decode(wire(Data(5, 0, 16, to_initiator=True).encode())).eager is False


def test_targets_are_the_dicts_they_always_were() -> None:
    assert Address(By.REQ_KEY, id=7, model_id=1).encode() == {
        "by": "req_key",
        "id": 7,
        "model_id": 1,
    }
    assert Address(By.BLOCKS_KEY, model_id=3).encode() == {"by": "blocks_key", "model_id": 3}
    assert Address(By.CACHE_ID, cache_id=4, index=2).encode() == {
        "by": "cache_id",
        "cache_id": 4,
        "index": 2,
    }
    assert Address(By.ADDRS).encode() == {"by": "addrs"}
    # A cache id without an index means slot 0, as it always did.
    assert Address.decode({"by": "cache_id", "cache_id": 4}) == Address(By.CACHE_ID, cache_id=4)


def test_control_frames_are_the_bytes_they_always_were() -> None:
    local, nbytes, remote = (np.array([1, 2], np.uint64) * k for k in (1, 8, 64))
    u8 = lambda a: np.ascontiguousarray(a, "<u8").data.cast("B")  # noqa: E731
    cases = [
        # The hot frames are packed (wire version 2): status, presence bits (mode, total,
        # no DONE), the mode's index (local 0, stream 1), the total.
        (
            Grant(3, mode=Mode.STREAM, total=24, done=False, local=local, nbytes=nbytes),
            Message(
                MT.GRANT,
                3,
                {},
                {"local": u8(local), "nbytes": u8(nbytes)},
                packed=struct.pack("<iBBq", 0, 7, 1, 24),
            ),
        ),
        (
            Grant(3, mode=Mode.LOCAL, total=24, local=local, nbytes=nbytes, remote=remote),
            Message(
                MT.GRANT,
                3,
                {},
                {"local": u8(local), "nbytes": u8(nbytes), "remote": u8(remote)},
                packed=struct.pack("<iBBq", 0, 3, 0, 24),
            ),
        ),
        (
            Grant.refusal(5, LLMStatusCode.LLM_LINK_BUSY, "busy"),
            Message(MT.GRANT, 5, {"status": int(LLMStatusCode.LLM_LINK_BUSY), "message": "busy"}),
        ),
        (
            Data(9, 5, 100, to_initiator=True),
            Message(
                MT.DATA, 9, payload_len=100, flags=FLAG_TO_INITIATOR, packed=struct.pack("<Q", 5)
            ),
        ),
        (Done(9), Message(MT.DONE, 9, packed=struct.pack("<i", 0))),
        (Result(9), Message(MT.RESULT, 9, packed=struct.pack("<i", 0))),
        (
            Done(9, LLMStatusCode.LLM_TIMEOUT, "late"),
            Message(MT.DONE, 9, {"status": int(LLMStatusCode.LLM_TIMEOUT), "message": "late"}),
        ),
        (
            Abort(9, LLMStatusCode.LLM_TIMEOUT, "late", to_initiator=True),
            Message(
                MT.ABORT,
                9,
                {"status": int(LLMStatusCode.LLM_TIMEOUT), "message": "late"},
                flags=FLAG_TO_INITIATOR,
            ),
        ),
        (
            Abort(9, LLMStatusCode.LLM_LINK_FAILED, "bad mac", broken=True),
            Message(
                MT.ABORT,
                9,
                {
                    "status": int(LLMStatusCode.LLM_LINK_FAILED),
                    "message": "bad mac",
                    "broken": True,
                },
            ),
        ),
        (Ping(), Message(MT.PING)),
        (UnlinkAck(), Message(MT.UNLINK_ACK)),
        (Hello("ab", 1), Message(MT.HELLO, 0, {"version": 1, "nonce": "ab"})),
        (Challenge("cd", True), Message(MT.CHALLENGE, 0, {"nonce": "cd", "auth": True})),
        (
            LinkRefused(LLMStatusCode.LLM_PARAM_INVALID, "no", 4, yielded=True),
            Message(
                MT.LINK_ACK,
                0,
                {
                    "status": int(LLMStatusCode.LLM_PARAM_INVALID),
                    "message": "no",
                    "cluster_id": 4,
                    "yield": True,
                },
            ),
        ),
        (
            LinkRefused(LLMStatusCode.LLM_LINK_FAILED),
            Message(MT.LINK_ACK, 0, {"status": int(LLMStatusCode.LLM_LINK_FAILED)}),
        ),
    ]
    for typed, old in cases:
        assert encode(typed.encode()) == encode(old), typed


def test_an_identity_is_the_handshake_fields_it_always_was() -> None:
    fields = {
        "cluster_id": 2,
        "role": 1,
        "remote_accessible": False,
        "payload_auth": True,
        "host": {"hostname": "h", "boot_id": "b"},
        "transport": "auto",
        "uds": None,
    }
    x = Identity.decode(Message(MT.LINK_REQ, 0, fields))
    assert encode(x.encode()) == encode(Message(MT.LINK_REQ, 0, fields))
    keyed = Identity.decode(Message(MT.LINK_REQ, 0, {**fields, "mac": "00"}))
    assert encode(keyed.encode()) == encode(Message(MT.LINK_REQ, 0, {**fields, "mac": "00"}))
    ack = Message(MT.LINK_ACK, 0, {"status": 0, **fields})
    assert encode(x.encode(MT.LINK_ACK)) == encode(ack)


def test_a_table_is_the_registry_table_it_always_was() -> None:
    cache = {
        "cache_id": 1,
        "addrs": [4096, 8192],
        "tensor_bytes": 64,
        "count": 1,
        "is_blocks": False,
        "placement": 0,
        "remote_accessible": True,
    }
    fields = {
        "caches": [cache],
        "blocks_keys": {"0": 1},
        "slot_keys": [["req", 7, 0, 1, 0]],
        "epoch": [4096, 3],
        "nixl": {"md": "AA==", "gen": 1},
    }
    t = Table.decode(wire(Message(MT.TABLE, 0, fields)))
    assert t.caches == (CacheInfo(1, (4096, 8192), 64, 1, False, 0, True),)
    assert t.epoch == (4096, 3) and t.blocks_keys == {"0": 1}
    assert encode(t.encode()) == encode(Message(MT.TABLE, 0, fields))


# ---------------------------------------------------------------------------- malformed
#: a request field -> values that must each be refused
BAD_REQUEST_FIELDS: dict[str, list[Any]] = {
    "op": [None, "read", 1, ["pull"]],
    "shape": [None, "slots", 0],
    "target": [None, "cache_id", {"by": "nope"}, {"by": "cache_id"}, {"by": "req_key", "id": "7"}],
    "layout": [None, [64, 1], [64, 1, "no"], [-1, 1, False], [1.5, 1, False], "x"],
    "caps": ["nixl", ["pvr"], 1],
    "timeout_ms": [-1, "60", 1.0, True],
    "local_slot": ["0", 0.5, True, 2**64],
    "size": [None, "big"],
    "src_offset": [[], False],
    "src_range": [[1], [0, "1"], "0:1", [0, 1, 2]],
    "dst_range": [{}, [None, 1]],
    "tnpl": [None, "2", 2.0],
    "dst_block_bytes": ["64", [64]],
    "raw": [[0, 1], [0, 1, 1], "raw"],
    "eager": [[0, 1], [1], [1, 2**63], "1,2", [True, 1], [-4, 1]],
}


def _valid_request() -> Message:
    return Request(
        1,
        Op.PULL,
        Address(By.CACHE_ID, cache_id=1),
        Shape.BLOCKS,
        (64, 8, True),
        np.array([4096], np.uint64),
        dst_blocks=np.array([1], np.uint64),
        src_blocks=np.array([2], np.uint64),
    ).encode()


def _valid_json_request() -> Message:
    """:func:`_valid_request` in the JSON form (a decoder reads both)."""
    return _old_request(Request.decode(_valid_request()))


@pytest.mark.parametrize(
    ("name", "bad"), [(k, v) for k, vs in BAD_REQUEST_FIELDS.items() for v in vs]
)
def test_a_malformed_request_field_is_a_protocol_error(name: str, bad: Any) -> None:
    ok = wire(_valid_json_request())
    Request.decode(ok)  # the valid one decodes
    msg = wire(Message(MT.XFER_REQ, 1, {**ok.fields, name: bad}, dict(ok.arrays)))
    with pytest.raises(ProtocolError):
        Request.decode(msg)


def test_a_request_without_the_arrays_it_needs_is_a_protocol_error() -> None:
    ok = wire(_valid_json_request())
    with pytest.raises(ProtocolError, match="initiator's layout"):
        Request.decode(Message(MT.XFER_REQ, 1, ok.fields, {}))
    by_addr = {**ok.fields, "target": {"by": "addrs"}}
    with pytest.raises(ProtocolError, match="without addresses"):
        Request.decode(Message(MT.XFER_REQ, 1, by_addr, dict(ok.arrays)))
    with pytest.raises(ProtocolError, match="expected XFER_REQ"):
        Request.decode(Message(MT.GRANT, 1, ok.fields, dict(ok.arrays)))


def test_unknown_fields_and_caps_are_ignored() -> None:
    ok = wire(_valid_json_request())
    extra = {**ok.fields, "junk": "x" * 100, "caps": {"pvr": True, "warp": True, "pools": 1}}
    r = Request.decode(Message(MT.XFER_REQ, 1, extra, dict(ok.arrays)))
    assert r.caps == frozenset({Cap.PVR})  # only true, known caps


@pytest.mark.parametrize(
    ("fields", "arrays", "why"),
    [
        ({"status": 0}, {}, "without a plan"),
        ({"status": 0, "mode": "stream"}, {"local": b"\0" * 8}, "without a plan"),
        (
            {"status": 0, "mode": "stream"},
            {"local": b"\0" * 16, "nbytes": b"\0" * 8},
            "without a plan",
        ),
        ({"status": 0, "mode": "local"}, {"local": b"\0" * 8, "nbytes": b"\0" * 8}, "remote"),
        ({"status": 0, "mode": "rdma"}, {"local": b"\0" * 8, "nbytes": b"\0" * 8}, "mode"),
        ({"status": 0, "mode": "stream", "done": 0}, {"local": b"", "nbytes": b""}, "done"),
        ({"status": 0, "mode": "stream", "total": -1}, {"local": b"", "nbytes": b""}, "total"),
        ({"status": 3, "message": 5}, {}, "message"),
    ],
)
def test_a_malformed_grant_is_a_protocol_error(
    fields: dict[str, Any], arrays: dict[str, bytes], why: str
) -> None:
    with pytest.raises(ProtocolError, match=why):
        Grant.decode(wire(Message(MT.GRANT, 1, fields, arrays)))


def test_a_refusal_needs_no_plan_and_a_status_is_read_leniently() -> None:
    g = Grant.decode(wire(Message(MT.GRANT, 1, {"status": 4})))
    assert not g.ok and g.message is None and g.local is None
    for bad in ("0", None, 1.0, True, 10**6):
        assert Grant.decode(Message(MT.GRANT, 1, {"status": bad})).status == (
            LLMStatusCode.LLM_FAILED
        )
        assert wire_status(Message(MT.DONE, 1, {"status": bad})) == LLMStatusCode.LLM_FAILED
    assert not Done.decode(Message(MT.DONE, 1, {})).ok


def test_a_peers_reason_is_bounded_and_made_a_string() -> None:
    a = Abort.decode(Message(MT.ABORT, 1, {"status": 2, "message": "x" * 10_000}))
    assert a.message == "x" * MAX_REASON and not a.broken and not a.to_initiator
    a = Abort.decode(Message(MT.ABORT, 1, {"message": ["no"], "broken": 1}, flags=1))
    assert a.message == "['no']" and not a.broken and a.to_initiator
    assert Abort.decode(Message(MT.ABORT, 1, {"broken": True})).broken


@pytest.mark.parametrize("off", [None, -1, "0", 1.0, 2**64])
def test_a_data_frame_needs_an_offset(off: Any) -> None:
    with pytest.raises(ProtocolError):
        Data.decode(Message(MT.DATA, 1, {} if off is None else {"off": off}))


def test_bare_frames_ignore_what_a_peer_adds() -> None:
    junk = {"junk": np.zeros(4, "<u8").tobytes()}
    assert Ping.decode(wire(Message(MT.PING, 0, {"x": 1}, junk))) == Ping()
    with pytest.raises(ProtocolError):
        Pong.decode(Message(MT.PING))


@pytest.mark.parametrize(
    ("cls", "mtype", "fields"),
    [
        (Hello, MT.HELLO, {"version": "1", "nonce": "a"}),
        (Hello, MT.HELLO, {"version": 1}),
        (Challenge, MT.CHALLENGE, {"nonce": "a", "auth": 1}),
        (Challenge, MT.CHALLENGE, {"nonce": 5, "auth": True}),
        (Identity, MT.LINK_REQ, {"cluster_id": -1}),
        (Identity, MT.LINK_REQ, {"cluster_id": 2**64}),
        (Identity, MT.LINK_REQ, {"cluster_id": True}),
    ],
)
def test_malformed_handshake_fields_are_protocol_errors(
    cls: Any, mtype: MT, fields: dict[str, Any]
) -> None:
    with pytest.raises(ProtocolError):
        cls.decode(Message(mtype, 0, fields))


def test_a_malformed_identity_field_is_a_protocol_error() -> None:
    good = {
        "cluster_id": 2,
        "role": 1,
        "remote_accessible": False,
        "payload_auth": False,
        "host": None,
        "transport": "tcp",
        "uds": None,
    }
    Identity.decode(Message(MT.LINK_REQ, 0, good))
    for name, bad in (
        ("role", "p"),
        ("remote_accessible", 1),
        ("payload_auth", None),
        ("host", "h"),
        ("transport", None),
        ("uds", 3),
        ("mac", 7),
    ):
        with pytest.raises(ProtocolError):
            Identity.decode(Message(MT.LINK_REQ, 0, {**good, name: bad}))


junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


#: a LINK_REQ as the last release (3fdd013, ``_links.LinkManager.identity``) sent it: these
#: fields, none more (the MAC added on a keyed link)
LAST_RELEASE_LINK_REQ: dict[str, Any] = {
    "cluster_id": 7,
    "role": 1,
    "remote_accessible": True,
    "payload_auth": False,
    "host": {
        "hostname": "node-3",
        "boot_id": "0b7e6c9a-4a1f-4c3e-9d2a-5f1e2d3c4b5a",
        "pidns": 4026531836,
        "netns": 4026531840,
    },
    "transport": "auto",
    "uds": "llmdd-async/1234/9f8e7d6c",
}


def test_a_last_release_link_req_reads_as_it_always_did() -> None:
    for fields in (LAST_RELEASE_LINK_REQ, {**LAST_RELEASE_LINK_REQ, "mac": "ab" * 32}):
        old = encode(Message(MT.LINK_REQ, 0, fields))  # the old encoder: the dict as it was
        x = Identity.decode(wire(Message(MT.LINK_REQ, 0, fields)))
        assert x == Identity(
            7,
            1,
            True,
            False,
            Host("node-3", "0b7e6c9a-4a1f-4c3e-9d2a-5f1e2d3c4b5a", 4026531836, 4026531840),
            "auto",
            "llmdd-async/1234/9f8e7d6c",
            fields.get("mac"),
        )
        assert encode(x.encode()) == old  # and our own identity is those bytes again
        ack = {"status": 0, **fields}
        assert Identity.decode(wire(Message(MT.LINK_ACK, 0, ack))) == x
        assert encode(x.encode(MT.LINK_ACK)) == encode(Message(MT.LINK_ACK, 0, ack))
    # Its side channel off: no name, as it sent it.
    x = Identity.decode(wire(Message(MT.LINK_REQ, 0, {**LAST_RELEASE_LINK_REQ, "uds": None})))
    assert x.uds is None


def test_fields_an_older_peer_leaves_out_read_as_the_raw_reads_did() -> None:
    """Absent is what ``peer.get(...)`` gave: False for the flags (``bool(None)``), None for
    the rest; a peer from before ``llm.PayloadAuth`` sends no ``payload_auth``."""
    before_payload_auth = {k: v for k, v in LAST_RELEASE_LINK_REQ.items() if k != "payload_auth"}
    assert Identity.decode(wire(Message(MT.LINK_REQ, 0, before_payload_auth))).payload_auth is False
    bare = Identity.decode(wire(Message(MT.LINK_REQ, 0, {"cluster_id": 3})))
    assert bare == Identity(3, None, False, False, None, None, None)
    assert encode(bare.encode()) == encode(
        Message(
            MT.LINK_REQ,
            0,
            {
                "cluster_id": 3,
                "remote_accessible": False,
                "payload_auth": False,
                "host": None,
                "uds": None,
            },
        )
    )
    assert Identity.decode(bare.encode()) == bare
    partial = Identity.decode(Message(MT.LINK_REQ, 0, {"cluster_id": 3, "host": {"x": 1}}))
    assert partial.host == Host()  # unknown keys ignored, missing parts None
    # Unknown fields (a later release's) are ignored.
    extra = {**LAST_RELEASE_LINK_REQ, "pad": "x" * 100, "pid": 5}
    assert Identity.decode(Message(MT.LINK_REQ, 0, extra)) == Identity.decode(
        Message(MT.LINK_REQ, 0, LAST_RELEASE_LINK_REQ)
    )


@pytest.mark.parametrize(
    "host",
    [
        "node-3",
        ["not", "a", "dict"],
        5,
        {"hostname": 5},
        {"boot_id": ["b"]},
        {"pidns": "4026531836"},
        {"netns": True},
        {"pidns": 2**64},
    ],
)
def test_a_malformed_host_is_a_protocol_error(host: Any) -> None:
    fields = {**LAST_RELEASE_LINK_REQ, "host": host}
    with pytest.raises(ProtocolError):
        Identity.decode(wire(Message(MT.LINK_REQ, 0, fields)))
    with pytest.raises(ProtocolError):
        Identity.decode(wire(Message(MT.LINK_ACK, 0, {"status": 0, **fields})))


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("cluster_id", "7"),
        ("cluster_id", None),
        ("role", None),
        ("role", 1.0),
        ("remote_accessible", "yes"),
        ("remote_accessible", 0),
        ("payload_auth", "0"),
        ("transport", 5),
        ("uds", ["llmdd-async"]),
        ("mac", 0),
    ],
)
def test_a_malformed_identity_field_is_a_protocol_error_through_the_bytes(
    name: str, bad: Any
) -> None:
    for mtype, extra in ((MT.LINK_REQ, {}), (MT.LINK_ACK, {"status": 0})):
        fields = {**extra, **LAST_RELEASE_LINK_REQ, name: bad}
        with pytest.raises(ProtocolError):
            Identity.decode(wire(Message(mtype, 0, fields)))


def test_a_host_shares_a_kernel_only_with_one_that_claims_its_boot_and_namespaces() -> None:
    me = Host("a", "boot", 1, 2)
    assert me.shares(Host("b", "boot", 1, 2))  # the name is a hint for the log only
    assert not me.shares(None)
    assert not me.shares(Host("a", "other", 1, 2))
    assert not me.shares(Host("a", "boot", 3, 2))
    assert not me.shares(Host("a", "boot", 1, 3))
    assert not me.shares(Host("a", "boot", 1, None))
    assert not Host("a", "", 1, 2).shares(Host("a", "", 1, 2))  # no boot id: nothing known
    assert not Host().shares(Host())


def test_the_version_is_read_before_anything_else_of_a_hello() -> None:
    other = wire(Message(MT.HELLO, 0, {"version": 2, "nonce": 5, "more": []}))
    assert Hello.version_of(other) == 2  # what the "client speaks protocol 2" error says
    with pytest.raises(ProtocolError):
        Hello.decode(other)
    assert Hello.version_of(wire(Message(MT.HELLO, 0, {}))) is None
    assert Hello.version_of(wire(Hello("n", 1).encode())) == 1


identity_names = st.sampled_from([*LAST_RELEASE_LINK_REQ, "mac", "status"])


@SETTINGS
@given(
    st.sampled_from([MT.LINK_REQ, MT.LINK_ACK]),
    st.dictionaries(identity_names, junk, max_size=4),
    st.lists(identity_names, max_size=3),
)
def test_any_identity_decodes_or_raises_protocol_error_and_nothing_else(
    mtype: MT, changed: dict[str, Any], dropped: list[str]
) -> None:
    fields = {"status": 0, **LAST_RELEASE_LINK_REQ, **changed}
    for name in dropped:
        fields.pop(name, None)
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        x = Identity.decode(wire(Message(mtype, 0, fields)))
        assert Identity.decode(wire(x.encode(mtype))) == x


# ---------------------------------------------------------------------------- NIXL entry
#: a TABLE's NIXL entry as ``NixlEndpoint.table_entry`` publishes it (last release too)
NIXL_ENTRY: dict[str, Any] = {
    "agent": "llmdd-1-abc",
    "gen": 3,
    "md": "bWV0YWRhdGE=",
    "mem": {"1": ["DRAM", 0], "2": ["VRAM", 1]},
}


def test_a_nixl_entry_is_read_once_from_the_table() -> None:
    table = Table.decode(wire(Message(MT.TABLE, 0, {"caches": [], "nixl": NIXL_ENTRY})))
    nx = NixlInfo.of(table.nixl)
    assert nx == NixlInfo("llmdd-1-abc", 3, "bWV0YWRhdGE=", {"1": ("DRAM", 0), "2": ("VRAM", 1)})
    assert nx.metadata() == b"metadata" and nx.fields() == NIXL_ENTRY
    assert NixlInfo.of(Table.decode(wire(Table().encode())).nixl) is None  # none published
    # No generation, no memory types: read as before (loaded each time, nothing registered).
    assert NixlInfo.of({"agent": "a", "md": ""}) == NixlInfo("a", None, "", {})


@pytest.mark.parametrize(
    "entry",
    [
        {**NIXL_ENTRY, "md": 5},
        {k: v for k, v in NIXL_ENTRY.items() if k != "md"},
        {**NIXL_ENTRY, "agent": None},
        {k: v for k, v in NIXL_ENTRY.items() if k != "agent"},
        {**NIXL_ENTRY, "gen": "3"},
        {**NIXL_ENTRY, "gen": True},
        {**NIXL_ENTRY, "mem": ["DRAM", 0]},
        {**NIXL_ENTRY, "mem": {"1": "DRAM"}},
        {**NIXL_ENTRY, "mem": {"1": ["DRAM"]}},
        {**NIXL_ENTRY, "mem": {"1": ["DRAM", "0"]}},
        {**NIXL_ENTRY, "mem": {"1": [0, 0]}},
    ],
)
def test_a_malformed_nixl_entry_is_a_protocol_error(entry: dict[str, Any]) -> None:
    table = Table.decode(wire(Message(MT.TABLE, 0, {"caches": [], "nixl": entry})))
    with pytest.raises(ProtocolError):
        NixlInfo.of(table.nixl)


def test_nixl_metadata_that_is_not_base64_is_a_protocol_error() -> None:
    nx = NixlInfo.of({**NIXL_ENTRY, "md": "not base64!"})
    assert nx is not None
    with pytest.raises(ProtocolError):
        nx.metadata()


@SETTINGS
@given(st.dictionaries(st.sampled_from([*NIXL_ENTRY, "x"]), junk, max_size=5))
def test_any_nixl_entry_decodes_or_raises_protocol_error_and_nothing_else(
    changed: dict[str, Any],
) -> None:
    table = Table.decode(wire(Message(MT.TABLE, 0, {"nixl": {**NIXL_ENTRY, **changed}})))
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        nx = NixlInfo.of(table.nixl)
        if nx is not None:
            nx.metadata()


#: a TABLE's Mooncake entry as ``MooncakeEndpoint.table_entry`` publishes it
MOONCAKE_ENTRY: dict[str, Any] = {
    "host": "10.0.0.1", "port": 15000, "gen": 2, "caches": [1, 4], "instance": 9
}  # fmt: skip


def test_a_mooncake_entry_is_read_once_from_the_table() -> None:
    table = Table.decode(wire(Message(MT.TABLE, 0, {"caches": [], "mooncake": MOONCAKE_ENTRY})))
    mc = MooncakeInfo.of(table.mooncake)
    assert mc == MooncakeInfo("10.0.0.1", 15000, 2, (1, 4), 9)
    assert mc.session == "10.0.0.1:15000" and mc.fields() == MOONCAKE_ENTRY
    assert Table.decode(wire(Table(mooncake=MOONCAKE_ENTRY).encode())).mooncake == MOONCAKE_ENTRY
    assert MooncakeInfo.of(Table.decode(wire(Table().encode())).mooncake) is None
    assert MooncakeInfo("fd00::1", 7, 0).session == "[fd00::1]:7"  # Mooncake's IPv6 names


@pytest.mark.parametrize(
    "entry",
    [
        {k: v for k, v in MOONCAKE_ENTRY.items() if k != "host"},
        {**MOONCAKE_ENTRY, "host": ""},
        {**MOONCAKE_ENTRY, "host": 7},
        {**MOONCAKE_ENTRY, "host": "10.0.0.1:99"},  # a port smuggled into the host: no
        {**MOONCAKE_ENTRY, "host": "[fd00::1]"},
        {**MOONCAKE_ENTRY, "host": "a b"},
        {**MOONCAKE_ENTRY, "host": "h" * 256},
        {**MOONCAKE_ENTRY, "port": 0},
        {**MOONCAKE_ENTRY, "port": 65536},
        {**MOONCAKE_ENTRY, "port": "15000"},
        {**MOONCAKE_ENTRY, "gen": -1},
        {**MOONCAKE_ENTRY, "gen": True},
        {k: v for k, v in MOONCAKE_ENTRY.items() if k != "instance"},
        {**MOONCAKE_ENTRY, "instance": -1},
        {**MOONCAKE_ENTRY, "instance": "9"},
        {**MOONCAKE_ENTRY, "caches": "1"},
        {**MOONCAKE_ENTRY, "caches": [-1]},
        {**MOONCAKE_ENTRY, "caches": [1.5]},
        {k: v for k, v in MOONCAKE_ENTRY.items() if k != "caches"},
    ],
)
def test_a_malformed_mooncake_entry_is_a_protocol_error(entry: dict[str, Any]) -> None:
    table = Table.decode(wire(Message(MT.TABLE, 0, {"caches": [], "mooncake": entry})))
    with pytest.raises(ProtocolError):
        MooncakeInfo.of(table.mooncake)


@SETTINGS
@given(st.dictionaries(st.sampled_from([*MOONCAKE_ENTRY, "x"]), junk, max_size=5))
def test_any_mooncake_entry_decodes_or_raises_protocol_error_and_nothing_else(
    changed: dict[str, Any],
) -> None:
    table = Table.decode(wire(Message(MT.TABLE, 0, {"mooncake": {**MOONCAKE_ENTRY, **changed}})))
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        MooncakeInfo.of(table.mooncake)


def test_malformed_table_entries_count_as_nothing() -> None:
    good = CacheInfo(1, (4096,), 64, 1, False, 0, True).encode()
    fields = {
        "caches": [good, {**good, "addrs": "x"}, {**good, "tensor_bytes": -1}, 5, {}],
        "blocks_keys": {"0": 1, "1": "x"},
        "slot_keys": [["req", 1, 0, 1, 0], ["req", "1"], 3],
        "epoch": [0, 1],
        "nixl": "md",
    }
    t = Table.decode(wire(Message(MT.TABLE, 0, fields)))
    assert [c.cache_id for c in t.caches] == [1]
    assert t.blocks_keys == {"0": 1} and t.slot_keys == (("req", 1, 0, 1, 0),)
    assert t.epoch is None and t.nixl is None
    assert Table.decode(Message(MT.TABLE, 0, {"caches": {}})) == Table()


@SETTINGS
@given(
    st.sampled_from(
        [Request, Grant, Data, Done, Result, Abort, Table, Hello, Challenge, LinkRefused]
    ),
    st.dictionaries(
        st.sampled_from(
            [
                *("op", "target", "shape", "layout", "caps", "status", "mode", "off", "nonce"),
                *("version", "auth", "caches", "epoch", "message", "done", "raw", "src_range"),
            ]
        ),
        junk,
        max_size=6,
    ),
    st.dictionaries(
        st.sampled_from(["local_addrs", "src_blocks", "raw_addrs", "local", "nbytes", "remote"]),
        st.binary(max_size=32).map(lambda b: b[: len(b) // 8 * 8]),
        max_size=4,
    ),
)
def test_any_fields_decode_or_raise_protocol_error_and_nothing_else(
    cls: Any, fields: dict[str, Any], arrays: dict[str, bytes]
) -> None:
    mtype = {
        Request: MT.XFER_REQ,
        Grant: MT.GRANT,
        Data: MT.DATA,
        Done: MT.DONE,
        Result: MT.RESULT,
        Abort: MT.ABORT,
        Table: MT.TABLE,
        Hello: MT.HELLO,
        Challenge: MT.CHALLENGE,
        LinkRefused: MT.LINK_ACK,
    }[cls]
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        cls.decode(wire(Message(mtype, 1, fields, arrays)))


# ---------------------------------------------------------------------------- side channel
_CACHE = {
    "cache_id": 1,
    "addrs": [4096, 8192],
    "tensor_bytes": 64,
    "count": 1,
    "is_blocks": False,
    "placement": 0,
    "remote_accessible": True,
}
tcp_ends = st.tuples(st.text(max_size=15), st.integers(0, 65535))
proofs = st.builds(
    Proof,
    st.lists(st.tuples(u64, u64), max_size=3).map(tuple),
    st.tuples(u64, st.text(max_size=8)),  # a probe address
    st.lists(cache_infos, max_size=3).map(tuple),
)


@SETTINGS
@given(
    st.builds(Prove, st.tuples(words, words), st.tuples(tcp_ends, tcp_ends), opt(words))
    | st.builds(ProveAck, st.just(True), proofs, opt(words))
    | st.just(ProveAck(False))
    | st.builds(ProveFin, opt(proofs))
)
def test_every_side_channel_message_survives_the_bytes(x: Any) -> None:
    assert type(x).decode(wire(x.encode())) == x


def test_the_side_channel_messages_are_the_frames_they_always_were() -> None:
    nonces, tcp = ["ab", "cd"], [["127.0.0.1", 5000], ["127.0.0.1", 6000]]
    proof = {"pools": [[4096, 1 << 20]], "probe": [123, "00ff"], "caches": [_CACHE]}
    info = CacheInfo.decode(_CACHE)
    assert info is not None
    typed = Proof(((4096, 1 << 20),), (123, "00ff"), (info,))
    prove = Prove(("ab", "cd"), (("127.0.0.1", 5000), ("127.0.0.1", 6000)))
    cases = [
        (prove, Message(MT.PROVE, 0, {"nonces": nonces, "tcp": tcp})),
        (
            Prove(prove.nonces, prove.tcp, "m"),
            Message(MT.PROVE, 0, {"nonces": nonces, "tcp": tcp, "mac": "m"}),
        ),
        (ProveAck(False), Message(MT.PROVE_ACK, 0, {"status": 1})),
        (ProveAck(True, typed), Message(MT.PROVE_ACK, 0, {"status": 0, **proof})),
        (
            ProveAck(True, typed, "m"),
            Message(MT.PROVE_ACK, 0, {"status": 0, **proof, "mac": "m"}),
        ),
        (ProveFin(typed), Message(MT.PROVE_FIN, 0, proof)),
        (ProveFin(None), Message(MT.PROVE_FIN, 0, {})),
    ]
    for x, old in cases:
        assert encode(x.encode()) == encode(old), x
        assert type(x).decode(wire(old)) == x
    # what a proof lets the other reach is what a table of the same caches publishes
    got, want = typed.regions(), TableSnapshot(proof).regions
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert regions_of(())[0].size == 0


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"nonces": "ab", "tcp": [["h", 1], ["h", 2]]},
        {"nonces": ["a", 1], "tcp": [["h", 1], ["h", 2]]},
        {"nonces": ["a", "b", "c"], "tcp": [["h", 1], ["h", 2]]},
        {"nonces": ["a", "b"]},
        {"nonces": ["a", "b"], "tcp": [["h", 1]]},
        {"nonces": ["a", "b"], "tcp": [["h", "1"], ["h", 2]]},
        {"nonces": ["a", "b"], "tcp": [["h", 1], ["h", 70000]]},
        {"nonces": ["a", "b"], "tcp": [[1, 1], ["h", 2]]},
    ],
)
def test_a_malformed_prove_is_a_protocol_error(fields: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        Prove.decode(wire(Message(MT.PROVE, 0, fields)))


def test_side_channel_answers_are_read_leniently_as_they_always_were() -> None:
    # any status but 0 is a refusal; a MAC that is not a string is no MAC
    for status in (1, None, "0", 0.5, True, [0]):
        assert ProveAck.decode(wire(Message(MT.PROVE_ACK, 0, {"status": status}))) == ProveAck(
            False
        )
    ack = ProveAck.decode(wire(Message(MT.PROVE_ACK, 0, {"status": 0, "mac": 7})))
    assert ack.ok and ack.mac is None and ack.proof == Proof()
    prove = Prove.decode(
        wire(Message(MT.PROVE, 0, {"nonces": ["a", "b"], "tcp": [["h", 1], ["h", 2]], "mac": 5}))
    )
    assert prove.mac is None
    # a proof's malformed parts count as nothing: a malformed pool claim is None (refused)
    bad = {
        "pools": [[1, 2], [3, "x"]],
        "probe": ["x", 1],
        "caches": [_CACHE, {**_CACHE, "addrs": "x"}, 5],
    }
    fin = ProveFin.decode(wire(Message(MT.PROVE_FIN, 0, bad)))
    assert fin.proof is not None
    assert fin.proof.pools is None and fin.proof.probe is None
    assert [c.cache_id for c in fin.proof.caches] == [1]
    assert Proof.of({"pools": {"a": 1}}).pools is None
    for addr in (-1, 1 << 64):  # not an address (numpy would raise OverflowError later)
        assert Proof.of({"probe": [addr, "00ff"]}).probe is None
    assert Proof.of({"probe": [(1 << 64) - 1, "00ff"]}).probe == ((1 << 64) - 1, "00ff")
    assert Proof.of({"pools": []}).pools == () and Proof.of({}).pools == ()
    with pytest.raises(ProtocolError):
        ProveFin.decode(Message(MT.PROVE_ACK, 0, {}))


@SETTINGS
@given(
    st.sampled_from([Prove, ProveAck, ProveFin]),
    st.dictionaries(
        st.sampled_from(["nonces", "tcp", "mac", "status", "pools", "probe", "caches"]),
        junk,
        max_size=5,
    ),
)
def test_any_side_channel_fields_decode_or_raise_protocol_error_and_nothing_else(
    cls: Any, fields: dict[str, Any]
) -> None:
    mtype = {Prove: MT.PROVE, ProveAck: MT.PROVE_ACK, ProveFin: MT.PROVE_FIN}[cls]
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        cls.decode(wire(Message(mtype, 0, fields)))


# ---------------------------------------------------------------------------- table readers
hostile_tables = st.dictionaries(
    st.sampled_from(["caches", "blocks_keys", "slot_keys", "epoch", "nixl"]), junk, max_size=5
)


@SETTINGS
@given(hostile_tables, st.sampled_from(["blocks_key", "cache_id"]))
def test_a_hostile_table_resolves_to_a_clean_error_or_a_cache(
    fields: dict[str, Any], by: str
) -> None:
    from llmdd_async._errors import LLMException
    from llmdd_async._net.addressing import resolve_in_table
    from llmdd_async._net.peer_view import PeerView, TableSnapshot

    target = Address.decode({"by": by, "model_id": 0, "cache_id": 1, "index": 0})
    for table in (fields, TableSnapshot(fields)):
        try:
            resolved = resolve_in_table(table, target, 9)
        except LLMException as exc:  # what an honest table without that cache gets
            assert exc.status_code in (
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                LLMStatusCode.LLM_PARAM_INVALID,
            )
        else:
            assert resolved.by is By.CACHE_ID
    view = PeerView(lambda timeout_s: None)  # type: ignore[arg-type,return-value]
    view.adopt(fields)  # never raises: malformed entries count as nothing
    for cid in list(view.caches):
        view.layout(cid)


def test_a_table_snapshot_keeps_its_caches_typed_and_resolves_as_before() -> None:
    from llmdd_async._errors import LLMException
    from llmdd_async._net.addressing import resolve_in_table
    from llmdd_async._net.peer_view import PeerView, TableSnapshot

    hidden = {**_CACHE, "cache_id": 2, "remote_accessible": False, "addrs": []}
    fields = {
        "caches": [_CACHE, hidden],
        "blocks_keys": {"5": 1, "6": 2},
        "slot_keys": [],
        "epoch": [4096, 3],
    }
    snap = TableSnapshot(fields)
    # (its caches kept typed only: every object a link keeps costs the collector's passes)
    assert snap == {k: v for k, v in fields.items() if k != "caches"}
    assert snap.typed.caches == tuple(CacheInfo.decode(c) for c in fields["caches"])
    assert resolve_in_table(snap, Address(By.BLOCKS_KEY, model_id=5), 9) == Address(
        By.CACHE_ID, cache_id=1, index=0
    )
    assert resolve_in_table(snap, Address(By.CACHE_ID, cache_id=1, index=2), 9).index == 2
    req = Address(By.REQ_KEY, id=1, model_id=0)
    assert resolve_in_table(snap, req, 9) is req
    for target, code in (
        (Address(By.BLOCKS_KEY, model_id=7), LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
        (Address(By.CACHE_ID, cache_id=3), LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
        (Address(By.BLOCKS_KEY, model_id=6), LLMStatusCode.LLM_PARAM_INVALID),
    ):
        with pytest.raises(LLMException) as err:
            resolve_in_table(snap, target, 9)
        assert err.value.status_code == code
    view = PeerView(lambda timeout_s: None)  # type: ignore[arg-type,return-value]
    view.adopt(snap)
    assert view.epoch == (4096, 3) and sorted(view.caches) == [1, 2]
    assert view.caches[1] == CacheInfo.decode(_CACHE)
    lay = view.layout(1)
    assert lay is not None and lay.addr_list == [4096, 8192] and view.layout(2) is None
    assert [r.tolist() for r in view.regions] == [[4096, 8192], [4160, 8256]]


def test_a_snapshot_finds_a_cache_by_id_as_a_scan_of_the_table_does() -> None:
    """The snapshot's index by cache id keeps the scan's answer: a peer that lists one id
    twice is read by its first entry, whichever form of the table resolves it, and a link's
    view plans one-sided pulls with that entry too (before: with the last)."""
    from llmdd_async._errors import LLMException
    from llmdd_async._net.addressing import resolve_in_table
    from llmdd_async._net.peer_view import PeerView, TableSnapshot, cache_info

    hidden = {**_CACHE, "remote_accessible": False}
    many = [{**_CACHE, "cache_id": 100 + i, "remote_accessible": False} for i in range(1000)]
    for first, second, ok in ((_CACHE, hidden, True), (hidden, _CACHE, False)):
        fields = {"caches": [*many, first, second], "blocks_keys": {"5": 1}, "slot_keys": []}
        for table in (fields, TableSnapshot(fields)):
            info = cache_info(table, 1)
            assert info is not None and info.remote_accessible is ok
            assert cache_info(table, 2) is None and cache_info(table, None) is None
            assert cache_info(table, 1099) is not None
            for target in (Address(By.BLOCKS_KEY, model_id=5), Address(By.CACHE_ID, cache_id=1)):
                if ok:
                    assert resolve_in_table(table, target, 9).cache_id == 1
                else:
                    with pytest.raises(LLMException) as err:
                        resolve_in_table(table, target, 9)
                    assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        view = PeerView(lambda timeout_s: None)  # type: ignore[arg-type,return-value]
        view.adopt(TableSnapshot(fields))
        assert view.caches[1].remote_accessible is ok and (view.layout(1) is not None) is ok
        # (the regions too: the entries an id has after its first are nobody's, in a table
        # and in a same-host proof alike)
        assert bool(len(view.regions[0])) is ok
        assert bool(len(Proof.of({"pools": [], **fields}).regions()[0])) is ok


def _packed_frame(mtype: MT, packed: bytes, sizes: list[int], arrays: bytes = b"") -> bytes:
    """A packed frame written by hand (a hostile peer's)."""
    meta = struct.pack("<I", len(packed) | 1 << 31) + packed
    meta += struct.pack(f"<{len(sizes)}I", *sizes) + arrays
    head = (0x3144444C, PROTOCOL_VERSION, int(mtype), 1, len(meta), 0, 0)
    return struct.pack("<IHHQIIQ", *head) + meta


_REQ_OK = struct.pack("<BBBBH22q", 0, 1, 2, 32, 0, *([0] * 4 + [64, 8] + [0] * 16))
_NONE = 0xFFFFFFFF


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (_packed_frame(MT.XFER_REQ, _REQ_OK[:-1], [8, 8, 8, _NONE], b"\0" * 24), "packed XFER"),
        (_packed_frame(MT.XFER_REQ, b"\x09" + _REQ_OK[1:], [8, 8, 8, _NONE], b"\0" * 24), "op"),
        (
            _packed_frame(
                MT.XFER_REQ, _REQ_OK[:2] + b"\x09" + _REQ_OK[3:], [8] + [_NONE] * 3, b"\0" * 8
            ),
            "addressing",
        ),
        (_packed_frame(MT.XFER_REQ, _REQ_OK, [_NONE, 8, 8, _NONE], b"\0" * 16), "layout"),
        (_packed_frame(MT.XFER_REQ, _REQ_OK, [12, _NONE, _NONE, _NONE], b"\0" * 12), "bad size"),
        (_packed_frame(MT.XFER_REQ, _REQ_OK, [16, _NONE, _NONE, _NONE], b"\0" * 8), "bad size"),
        (_packed_frame(MT.XFER_REQ, _REQ_OK, [8, _NONE, _NONE, _NONE], b"\0" * 16), "unexplained"),
        (_packed_frame(MT.XFER_REQ, _REQ_OK, [8, _NONE], b"\0" * 8), "run past|bad size"),
        (
            _packed_frame(MT.GRANT, struct.pack("<iBBq", 0, 1, 7, 0), [8, 8, _NONE], b"\0" * 16),
            "mode",
        ),
        (
            _packed_frame(MT.GRANT, struct.pack("<iBBq", 0, 2, 1, -5), [8, 8, _NONE], b"\0" * 16),
            "total",
        ),
        (_packed_frame(MT.DATA, b"\0" * 7, []), "packed DATA"),
        (_packed_frame(MT.ABORT, struct.pack("<i", 0), []), "no packed form"),
        (_packed_frame(MT.TABLE, b"", []), "no packed form"),
    ],
)
def test_a_malformed_packed_frame_is_a_protocol_error(frame: bytes, why: str) -> None:
    decoders = {MT.XFER_REQ: Request.decode, MT.GRANT: Grant.decode, MT.DATA: Data.decode}
    with pytest.raises(ProtocolError, match=why):
        d = Decoder()
        d.receive_data(frame)
        msg = d.next_event()
        assert isinstance(msg, Message)
        decoders[msg.type](msg)


def test_a_packed_status_of_the_wrong_size_reads_as_failed() -> None:
    frame = _packed_frame(MT.DONE, b"\0" * 3, [])
    d = Decoder()
    d.receive_data(frame)
    msg = d.next_event()
    assert isinstance(msg, Message)
    assert Done.decode(msg).status == wire_status(msg) == LLMStatusCode.LLM_FAILED


def test_a_packed_message_of_an_unpackable_type_is_refused_when_encoded() -> None:
    with pytest.raises(ProtocolError, match="no packed form"):
        encode(Message(MT.ABORT, 1, packed=b"\0" * 4))
    with pytest.raises(ProtocolError, match="carries no arrays"):
        encode(Message(MT.GRANT, 1, {}, {"bogus": b"\0" * 8}, packed=b"\0" * 14))
