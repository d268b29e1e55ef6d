import json

import pytest

from torchpass import wire
from torchpass.errors import ProtocolError, RemoteError


def test_request_round_trip_keeps_every_envelope_field():
    frame = wire.encode("rank.progress", {"job_id": 7, "rank": 1, "step": 3, "collectives": 12},
                        id="abc", auth="cred", seq=5, sender="node2")
    msg = wire.decode(frame)
    assert msg == wire.Message("rank.progress", {"job_id": 7, "rank": 1, "step": 3, "collectives": 12},
                               "abc", "cred", 5, "node2")


@pytest.mark.parametrize(
    "obj, fragment",
    [
        ({"v": 2, "type": "job.status", "body": {}}, "unsupported schema version 2"),
        ({"type": "job.status", "body": {}}, "unsupported schema version None"),
        ({"v": True, "type": "job.status", "body": {}}, "unsupported schema version True"),
        ({"v": 1, "type": "no.such", "body": {}}, "unknown message type 'no.such'"),
        ({"v": 1, "type": "rank.progress", "body": {"job_id": 1, "rank": 0, "step": 1}}, "missing field 'collectives'"),
        ({"v": 1, "type": "rank.progress", "body": {"job_id": 1, "rank": "0", "step": 1, "collectives": 1}},
         "field 'rank' must be int, got str"),
        ({"v": 1, "type": "rank.progress", "body": {"job_id": True, "rank": 0, "step": 1, "collectives": 1}},
         "field 'job_id' must be int, got bool"),
        ({"v": 1, "type": "job.status", "body": {"x": 1}}, "unknown field(s) x"),
        ({"v": 1, "type": "job.status", "body": [], "id": "a"}, "body is not an object"),
        ({"v": 1, "type": "job.status", "body": {}, "evil": 1}, "unknown envelope field(s) evil"),
        ({"v": 1, "type": "job.status", "body": {}, "seq": -1}, "'seq' must be a non-negative integer"),
        ({"v": 1, "type": "reply", "ok": True}, "a reply was sent where a request was expected"),
    ],
)
def test_decode_rejects_bad_messages_with_a_reason(obj, fragment):
    with pytest.raises(ProtocolError) as exc:
        wire.decode(json.dumps(obj).encode())
    assert fragment in str(exc.value)


@pytest.mark.parametrize("frame", [b"", b"\xff\xfe", b"[1,2]", b"null", b'{"v":1', b"NaN",
                                   b'{"v":1,"type":"rank.progress","body":{"job_id":1,"rank":0,"step":NaN,"collectives":1}}'])
def test_garbage_is_a_protocol_error_never_another_exception(frame):
    with pytest.raises(ProtocolError):
        wire.decode(frame)


def test_oversized_frames_are_refused_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode(b" " * (wire.MAX_FRAME_BYTES + 1))


def test_error_reply_is_one_line_with_a_stable_code_and_unwraps_to_remote_error():
    frame = wire.encode_error("id1", "forbidden", "job 12 belongs to alice;\n  you are bob")
    reply = wire.decode_reply(frame)
    assert (reply.ok, reply.code, reply.message) == (False, "forbidden", "job 12 belongs to alice; you are bob")
    with pytest.raises(RemoteError) as exc:
        reply.unwrap()
    assert exc.value.code == "forbidden"
    with pytest.raises(ValueError):
        wire.encode_error("id", "made_up_code", "x")


def test_peek_id_recovers_the_request_id_of_a_bad_frame():
    assert wire.peek_id(b'{"v":9,"id":"r-17"}') == "r-17"
    assert wire.peek_id(b"\x00garbage") == ""
