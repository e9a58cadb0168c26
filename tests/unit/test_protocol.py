"""The sans-IO wire protocol, tested with bytes alone (no sockets), plus fuzzing."""

from __future__ import annotations

import contextlib
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmdd_async._errors import ProtocolError
from llmdd_async._protocol import (
    HEADER,
    MAGIC,
    MT,
    NEED_DATA,
    PROTOCOL_VERSION,
    Decoder,
    Message,
    PayloadBytes,
    encode,
)

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=20)
)
fields_st = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda k: k != "arrays"),
    st.one_of(json_scalars, st.lists(json_scalars, max_size=4)),
    max_size=5,
)
arrays_st = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.binary(max_size=64).map(lambda b: b[: len(b) // 8 * 8]),
    max_size=3,
)
messages = st.builds(
    Message,
    type=st.sampled_from(list(MT)),
    req_id=st.integers(0, 2**64 - 1),
    fields=fields_st,
    arrays=arrays_st,
    payload_len=st.integers(0, 300),
    flags=st.integers(0, 2**32 - 1),
)


def collect(decoder: Decoder) -> list[object]:
    out: list[object] = []
    while (ev := decoder.next_event()) is not NEED_DATA:
        out.append(ev)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=st.lists(messages, min_size=1, max_size=4), data=st.data())
def test_any_chunking_gives_back_the_same_frames(msgs: list[Message], data) -> None:
    stream = b""
    payloads = []
    for m in msgs:
        body = bytes(range(256)) * 2
        payload = body[: m.payload_len]
        payloads.append(payload)
        stream += encode(m) + payload
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec = Decoder()
    events: list[object] = []
    prev = 0
    for c in [*cuts, len(stream)]:
        dec.receive_data(stream[prev:c])
        events.extend(collect(dec))
        prev = c
    got_msgs = [e for e in events if isinstance(e, Message)]
    assert len(got_msgs) == len(msgs)
    # Payload bytes follow their frame, in order.
    frames: list[tuple[Message, bytes]] = []
    for e in events:
        if isinstance(e, Message):
            frames.append((e, b""))
        else:
            assert isinstance(e, PayloadBytes)
            m, p = frames[-1]
            frames[-1] = (m, p + bytes(e.data))
    for (got, payload), want, want_payload in zip(frames, msgs, payloads, strict=True):
        assert got.type == want.type and got.req_id == want.req_id and got.flags == want.flags
        assert got.fields == json.loads(json.dumps(want.fields))
        assert {k: bytes(v) for k, v in got.arrays.items()} == want.arrays
        assert got.payload_len == want.payload_len
        assert payload == want_payload


def test_payload_can_be_read_directly_by_the_io_layer() -> None:
    frame = encode(Message(MT.DATA, 7, {"off": 0}, payload_len=100))
    dec = Decoder()
    dec.receive_data(frame + b"x" * 30)  # 30 payload bytes arrived with the header
    msg = dec.next_event()
    assert isinstance(msg, Message) and msg.payload_len == 100
    ev = dec.next_event()
    assert isinstance(ev, PayloadBytes) and bytes(ev.data) == b"x" * 30
    assert dec.next_event() is NEED_DATA and dec.payload_remaining == 70
    dec.payload_consumed(70)  # the I/O layer received them straight into memory
    assert dec.payload_remaining == 0
    dec.receive_data(encode(Message(MT.DONE, 7, {"status": 0})))
    done = dec.next_event()
    assert isinstance(done, Message) and done.type == MT.DONE
    with pytest.raises(ProtocolError):
        dec.payload_consumed(1)


def test_take_payload_hands_out_the_buffered_payload_without_a_copy() -> None:
    frame = encode(Message(MT.DATA, 7, {"off": 0}, payload_len=100))
    after = encode(Message(MT.DONE, 7, {"status": 0}))
    dec = Decoder()
    dec.receive_data(frame + b"y" * 40)
    msg = dec.next_event()
    assert isinstance(msg, Message) and msg.payload_len == 100
    with dec.take_payload() as view:
        assert bytes(view) == b"y" * 40 and dec.payload_remaining == 60
        with pytest.raises(BufferError):  # the view is the decoder's buffer: release it first
            dec.receive_data(b"z")
    dec.receive_data(b"z" * 60 + after)  # the rest of the payload, then the next frame
    with dec.take_payload() as view:
        assert bytes(view) == b"z" * 60 and dec.payload_remaining == 0
    done = dec.next_event()
    assert isinstance(done, Message) and done.type == MT.DONE
    with dec.take_payload() as view:  # no payload pending: nothing
        assert view.nbytes == 0


def test_buffer_stays_bounded_when_chunks_never_end_on_a_frame() -> None:
    # A control-only link may never receive exactly up to a frame boundary; consumed bytes
    # must still be dropped, or the buffer grows with everything the link ever carried.
    frame = encode(Message(MT.PING, 1, {"pad": "x" * 1000}))
    stream = frame * 400
    dec = Decoder()
    chunk = 4096 + 7  # never a multiple of the frame size
    seen = 0
    for i in range(0, len(stream), chunk):
        dec.receive_data(stream[i : i + chunk])
        seen += len(collect(dec))
        assert len(dec._buf) < chunk + len(frame)
    assert seen == 400


def test_truncated_frames_wait_for_more_bytes() -> None:
    frame = encode(Message(MT.GRANT, 1, {"status": 0}, {"a": b"\0" * 16}))
    for cut in range(len(frame)):
        dec = Decoder()
        dec.receive_data(frame[:cut])
        assert dec.next_event() is NEED_DATA
        dec.receive_data(frame[cut:])
        assert isinstance(dec.next_event(), Message)


def header(magic=MAGIC, version=PROTOCOL_VERSION, mtype=int(MT.PING), meta_len=0, payload=0):
    return HEADER.pack(magic, version, mtype, 0, meta_len, 0, payload)


def meta(js: bytes, tail: bytes = b"") -> bytes:
    return struct.pack("<I", len(js)) + js + tail


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (header(magic=0xDEADBEEF) + meta(b"{}"), "bad magic"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"\0" * 32, "the peer speaks HTTP"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01" + b"\0" * 32, "the peer speaks TLS"),
        (header(version=9) + meta(b"{}"), "unsupported protocol version"),
        (header(mtype=999) + meta(b"{}"), "unknown message type"),
        (header(meta_len=1 << 30), "exceeds"),
        (header(payload=1 << 50) + meta(b"{}"), "absurd"),
        (header(meta_len=2) + b"\0\0", "shorter than its length prefix"),
        (header(meta_len=8) + struct.pack("<I", 100) + b"{}{}", "runs past"),
        (header(meta_len=len(meta(b"{nope"))) + meta(b"{nope"), "malformed JSON"),
        (header(meta_len=len(meta(b"[1,2]"))) + meta(b"[1,2]"), "JSON object"),
        (header(meta_len=len(meta(b"\xff\xfe"))) + meta(b"\xff\xfe"), "malformed JSON"),
        (header(meta_len=len(meta(b'{"arrays":5}'))) + meta(b'{"arrays":5}'), "must be a list"),
        (
            header(meta_len=len(meta(b'{"arrays":[["a",7]]}', b"\0" * 7)))
            + meta(b'{"arrays":[["a",7]]}', b"\0" * 7),
            "bad array entry",
        ),
        (
            header(meta_len=len(meta(b'{"arrays":[["a",16]]}', b"\0" * 8)))
            + meta(b'{"arrays":[["a",16]]}', b"\0" * 8),
            "runs past",
        ),
        (header(meta_len=len(meta(b"{}", b"junk"))) + meta(b"{}", b"junk"), "unexplained"),
        (
            header(
                mtype=int(MT.TABLE),
                meta_len=len(meta(b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}")),
            )
            + meta(b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}"),
            "malformed JSON",
        ),
        (
            header(meta_len=len(meta(b'{"arrays":[' + b",".join([b'["a",0]'] * 9) + b"]}")))
            + meta(b'{"arrays":[' + b",".join([b'["a",0]'] * 9) + b"]}"),
            "at most 8",
        ),
    ],
)
def test_malformed_frames_are_protocol_errors(data: bytes, why: str) -> None:
    dec = Decoder()
    dec.receive_data(data)
    with pytest.raises(ProtocolError, match=why):
        dec.next_event()
    with pytest.raises(ProtocolError):  # the decoder stays broken
        dec.next_event()
    with pytest.raises(ProtocolError):
        dec.receive_data(b"more")


def test_encode_rejects_odd_arrays() -> None:
    with pytest.raises(ProtocolError):
        encode(Message(MT.GRANT, 0, {}, {"a": b"\0" * 5}))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_never_crash_the_decoder(blob: bytes) -> None:
    dec = Decoder(max_meta=1 << 16)
    dec.receive_data(blob)
    with contextlib.suppress(ProtocolError):
        collect(dec)


@settings(max_examples=500, deadline=None)
@given(
    msg=messages,
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_corrupted_frames_never_crash_the_decoder(msg: Message, flips) -> None:
    frame = bytearray(encode(msg) + b"p" * msg.payload_len)
    for pos, val in flips:
        frame[pos % len(frame)] = val
    dec = Decoder(max_meta=1 << 16)
    dec.receive_data(bytes(frame))
    with contextlib.suppress(ProtocolError):
        collect(dec)


def test_authenticated_frames_round_trip_and_reject_tampering_replay_and_reorder() -> None:
    from llmdd_async._protocol import FrameAuth

    key = b"k" * 32
    msgs = [Message(MT.PING), Message(MT.TABLE, 0, {"caches": []}), Message(MT.PONG)]
    wire = [encode(m, sender) for sender in [FrameAuth(key)] for m in msgs]
    dec = Decoder()
    dec.set_auth(FrameAuth(key))
    for frame, m in zip(wire, msgs, strict=True):
        dec.receive_data(frame)
        got = dec.next_event()
        assert isinstance(got, Message) and got.type == m.type and got.fields == m.fields
    # A flipped bit, a replayed frame, a frame out of order, a frame under another key: refused.
    bad = bytearray(wire[0])
    bad[36] ^= 1  # the first byte of the JSON fields
    for stream in (bytes(bad), wire[0] + wire[0], wire[1], encode(msgs[0], FrameAuth(b"x" * 32))):
        d = Decoder()
        d.set_auth(FrameAuth(key))
        d.receive_data(stream)
        with pytest.raises(ProtocolError, match="authentication"):
            while True:
                assert d.next_event() is not NEED_DATA
    # Unauthenticated frames on a keyed link are refused too.
    d = Decoder()
    d.set_auth(FrameAuth(key))
    d.receive_data(encode(Message(MT.PING)))
    with pytest.raises(ProtocolError):
        d.next_event()


def test_a_frame_tag_and_a_payload_mac_are_the_documented_hmacs() -> None:
    # The wire's contract (an endpoint of another release must agree): a frame's tag is
    # HMAC-SHA256(key, seq as u64 LE || header || meta); a payload's MAC is keyed by
    # HMAC-SHA256(key, "payload") over seq as u64 LE || payload.
    import hashlib
    import hmac
    import struct

    from llmdd_async._protocol import FrameAuth

    key = bytes(range(32))
    auth = FrameAuth(key)
    for seq in range(3):
        header, meta = bytes([seq]) * 32, b"meta" * (seq + 1)
        want = hmac.new(key, struct.pack("<Q", seq) + header + meta, hashlib.sha256).digest()
        assert auth.tag(header, memoryview(meta)) == want
    mac = auth.payload_mac(9)
    mac.update(b"payload bytes")
    payload_key = hmac.new(key, b"payload", hashlib.sha256).digest()
    want = hmac.new(payload_key, struct.pack("<Q", 9) + b"payload bytes", hashlib.sha256)
    assert mac.digest() == want.digest()
    assert auth.payload_mac(9).digest() != mac.digest()  # (each MAC starts afresh)


@pytest.mark.parametrize(
    ("mtype", "size", "refused"),
    [
        (MT.XFER_REQ, 2 << 20, True),
        (MT.TABLE, 2 << 20, True),
        (MT.TABLE, 100 << 10, False),  # (a table, or the handshake's identity, may be big)
        (MT.PING, 100 << 10, True),  # (a peer's megabyte of JSON held the loop ~70 ms)
        (MT.ABORT, 100 << 10, True),
        (MT.GRANT, 100 << 10, True),
    ],
)
def test_json_fields_are_capped(mtype: MT, size: int, refused: bool) -> None:
    js = json.dumps({"x": "a" * size}, separators=(",", ":")).encode()
    frame = header(mtype=int(mtype), meta_len=len(meta(js))) + meta(js)
    d = Decoder()
    d.receive_data(frame)
    msg = Message(mtype, 0, {"x": "a" * size})
    if refused:
        with pytest.raises(ProtocolError, match="JSON fields"):
            d.next_event()
    else:
        assert d.next_event() == msg
        assert encode(msg) == frame


def _table_of(unit: str, count: int) -> bytes:
    return ('{"caches":[' + (unit * count).rstrip(",") + "]}").encode()


@pytest.mark.parametrize(
    ("unit", "refused"),
    [
        ("[[]],", "units"),  # (~100 ms of json.loads for a megabyte, in one call)
        ("1,", "units"),
        ('{"":0},', "units"),
        ('["req",123456,0,17,63],', "units"),  # keyed slots: 37k (590 KB) are taken
        ("1e-320,", "malformed"),  # (floats: up to 40 us each; no big fields carry them)
        ("140737488355328,", None),  # a table's addresses: ~70k units a megabyte
    ],
)
def test_big_json_fields_are_capped_by_what_they_cost_to_parse(
    unit: str, refused: str | None
) -> None:
    from llmdd_async._protocol.frames import MAX_FIELD_UNITS, MAX_FIELDS, json_units

    def decoded(js: bytes) -> object:
        frame = header(mtype=int(MT.TABLE), meta_len=len(meta(js))) + meta(js)
        d = Decoder()
        d.receive_data(frame + encode(Message(MT.PING)))
        msg = d.next_event()
        assert d.next_event() == Message(MT.PING)
        assert encode(Message(MT.TABLE, 0, json.loads(js))) == frame  # (as we send it)
        return msg

    # The most of ``unit`` within both caps: taken, unless it holds floats.
    count = min((MAX_FIELDS - 16) // len(unit), MAX_FIELD_UNITS // json_units(unit.encode()) + 4)
    while len(_table_of(unit, count)) > MAX_FIELDS or json_units(_table_of(unit, count)) > (
        MAX_FIELD_UNITS
    ):
        count -= 1
    js = _table_of(unit, count)
    if refused == "malformed":
        with pytest.raises(ProtocolError, match="malformed JSON"):
            decoded(js)
        return
    assert decoded(js) == Message(MT.TABLE, 0, json.loads(js))
    over = _table_of(unit, count + 1)
    if refused == "units":  # one more is refused, by a peer and by our encoder
        assert len(over) <= MAX_FIELDS and json_units(over) > MAX_FIELD_UNITS
        with pytest.raises(ProtocolError, match="units of parsing exceed"):
            decoded(over)
        with pytest.raises(ProtocolError, match="exceed what a peer takes"):
            encode(Message(MT.TABLE, 0, json.loads(over)))
    else:
        assert len(over) > MAX_FIELDS  # (the bytes' cap is reached first)


def test_what_big_json_fields_cost_is_counted_by_their_structure() -> None:
    from llmdd_async._protocol.frames import MAX_FIELD_UNITS, json_units

    assert json_units(b'[{"a":1},2]') == 2 + 2 + 2 + 1  # [ { : ,
    assert json_units(b'"[{:,"') == 7  # (inside strings too: it only over-counts)
    assert MAX_FIELD_UNITS == 1 << 18


@pytest.mark.parametrize(
    ("js", "refused"),
    [
        # 87k distinct keys at the cap: the costliest shape found (~40 ms here)
        ("{" + ",".join(f'"{i:x}":0' for i in range(87_000)) + "}", None),
        ('{"x":[' + ",".join(["NaN"] * 20_000) + "]}", "malformed"),  # (no floats at all)
        ('{"x":[' + ",".join(["18446744073709551615"] * 4000) + "]}", None),  # u64s: 20 digits
        ('{"x":[' + ",".join(["1" * 21] * 4000) + "]}", "over 20 digits"),  # (~100 us each)
    ],
)
def test_big_json_fields_are_refused_by_their_shape(js: str, refused: str | None) -> None:
    data = js.encode()
    assert len(data) > 64 << 10
    frame = header(mtype=int(MT.TABLE), meta_len=len(meta(data))) + meta(data)
    d = Decoder()
    d.receive_data(frame)
    if refused:
        with pytest.raises(ProtocolError, match=refused):
            d.next_event()
    else:
        assert d.next_event() == Message(MT.TABLE, 0, json.loads(data))


def test_a_reason_is_sent_as_long_as_the_peer_keeps_it() -> None:
    from llmdd_async._messages import MAX_REASON, Abort, Done

    long = "why " * 100_000
    for m in (Abort(1, 1, long), Done(1, 1, long)):
        sent = encode(m.encode())
        d = Decoder()
        d.receive_data(sent)
        got = d.next_event()
        assert isinstance(got, Message)
        assert got.fields["message"] == long[:MAX_REASON]


@given(
    text=st.one_of(
        st.integers(0, 10**30).map(str),
        st.just("9" * 5000),
        st.from_regex(r"[-+ 0-9_.e]{1,8}", fullmatch=True),
    )
)
def test_data_offsets_decode_exactly_as_json_would(text: str) -> None:
    """DATA frames' ``{"off":N}`` takes a fast path both ways; it must agree with JSON."""
    js = b'{"off":' + text.encode() + b"}"
    frame = (
        HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MT.DATA), 1, 4 + len(js), 0, 0)
        + struct.pack("<I", len(js))
        + js
    )
    try:
        want: object = json.loads(js)
    except ValueError:
        want = ProtocolError
    dec = Decoder()
    dec.receive_data(frame)
    if want is ProtocolError:
        with pytest.raises(ProtocolError):
            dec.next_event()
        return
    got = dec.next_event()
    assert isinstance(got, Message) and got.fields == want
    if isinstance(want, dict) and type(want["off"]) is int and want["off"] >= 0:
        assert (
            encode(Message(MT.DATA, 1, want))[HEADER.size + 4 :]
            == json.dumps(want, separators=(",", ":")).encode()
        )


@given(
    req_id=st.integers(0, 2**64 - 1),
    off=st.integers(0, 2**64 - 1),
    payload_len=st.integers(0, 2**40),
    to_initiator=st.booleans(),
    keyed=st.booleans(),
)
def test_a_data_frame_from_its_fields_is_the_encoders_frame(
    req_id: int, off: int, payload_len: int, to_initiator: bool, keyed: bool
) -> None:
    """``Data.frame`` and ``encode``'s DATA branch give the generic encoder's bytes (tag and
    sequence included), and the decoder reads them back as the same message."""
    from llmdd_async._messages import Data
    from llmdd_async._protocol import FrameAuth, frames

    data = Data(req_id, off, payload_len, to_initiator)
    msg = data.encode()
    auths = [FrameAuth(b"k" * 32) if keyed else None for _ in range(3)]
    generic = frames._encode_packed(msg, auths[0])
    assert encode(msg, auths[1]) == generic
    assert Data.frame(req_id, off, payload_len, to_initiator, auths[2]) == generic
    dec = Decoder()
    if keyed:
        dec.set_auth(FrameAuth(b"k" * 32))
    dec.receive_data(generic)
    assert Data.decode(dec.next_event()) == data  # type: ignore[arg-type]


def test_a_frame_nobody_waits_for_is_not_parsed() -> None:
    # (a table nobody asked for: its JSON, even malformed, is never parsed)
    js = b'{"caches": [nope'
    frame = header(mtype=int(MT.TABLE), meta_len=len(meta(js))) + meta(js)
    d = Decoder()
    d.unwanted = lambda mtype: mtype is MT.TABLE
    d.receive_data(frame + encode(Message(MT.PING, 7, {"a": 1})))
    assert d.next_event() == Message(MT.TABLE, 0)
    assert d.next_event() == Message(MT.PING, 7, {"a": 1})
    d.unwanted = lambda mtype: False
    d.receive_data(frame)
    with pytest.raises(ProtocolError, match="malformed JSON"):
        d.next_event()


def test_a_big_frame_is_hashed_as_it_comes_and_never_copied() -> None:
    # A 16 MiB meta on a keyed link was copied out of its mapping and hashed in one call (64
    # MiB: ~125 ms of the loop, ~29 ms unkeyed); it is now hashed a read at a time, and its
    # arrays are views of the mapping it was collected in.
    import mmap

    import numpy as np

    from llmdd_async._protocol import FrameAuth

    class Counting(FrameAuth):
        largest = 0

        def tag(self, header: bytes | memoryview, meta: bytes | memoryview) -> bytes:
            self.largest = max(self.largest, len(meta))
            return super().tag(header, meta)

        def start(self, header: bytes | memoryview) -> object:  # type: ignore[override]
            mac, outer = super().start(header), self

            class Fed:
                def update(self, data: memoryview) -> None:
                    outer.largest = max(outer.largest, len(data))
                    mac.update(data)

                def digest(self) -> bytes:
                    return mac.digest()

            return Fed()

    key, chunk = b"k" * 32, 1 << 20
    big = np.arange(2 << 20, dtype="<u8")  # 16 MiB
    msgs = [Message(MT.PING, 0, {}, {"a": big.data.cast("B")}), Message(MT.PONG)]
    for keyed in (False, True):
        sender = FrameAuth(key) if keyed else None
        wire = b"".join(encode(m, sender) for m in msgs)
        dec = Decoder(max_meta=32 << 20)
        auth = Counting(key)
        if keyed:
            dec.set_auth(auth)
        got: list[object] = []
        for i in range(0, len(wire), chunk):
            dec.receive_data(wire[i : i + chunk])
            got += collect(dec)
        assert [m.type for m in got] == [MT.PING, MT.PONG]  # type: ignore[attr-defined]
        arr = got[0].arrays["a"]  # type: ignore[attr-defined]
        assert isinstance(arr, memoryview) and isinstance(arr.obj, mmap.mmap)
        assert arr.readonly  # as a smaller frame's bytes are
        assert (np.frombuffer(arr, "<u8") == big).all()
        if keyed:
            assert 0 < auth.largest <= chunk
            bad = bytearray(wire)
            bad[8 << 20] ^= 1  # in the middle of the array
            dec = Decoder(max_meta=32 << 20)
            dec.set_auth(FrameAuth(key))
            with pytest.raises(ProtocolError, match="authentication"):
                for i in range(0, len(bad), chunk):
                    dec.receive_data(bytes(bad[i : i + chunk]))
                    collect(dec)
