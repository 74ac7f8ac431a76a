"""Every message between the controller and its stage processes is typed and crosses the
network codec (engine/pipeline/wire.py) as it is: registered, round-tripped, versioned."""
import dataclasses

import numpy as np
import pytest

from engine.events import StageEvent
from engine.pipeline import stage_messages as sm
from engine.pipeline import wire
from engine.pipeline.stage_process import RunOrder, SourceRef, StageSpec

EXAMPLES = [
    sm.Ping(), sm.BeginRun(RunOrder(run_id="r", ids=[1, 2], bounds=[(0, 2)], capacity=3, chunk=2, depth=1,
                                    logits_all=False, events=True, check_nan=True, prefill_main=False)),
    sm.RunChunk(3), sm.EndPrefill(), sm.DecodeStep(1, 42, 17), sm.EndRun(), sm.Measure((256, 1024), 1024, 256, 2, True),
    sm.Stop(), sm.Refused("rank taken"),
    sm.Assign(StageSpec(rank=1, world=2, device="cpu", first=2, end=4, source=SourceRef("gguf", path="/m.gguf"),
                        dtype="float32", store_host="", store_port=0, backend="gloo", threads=1, timeout_s=60.0,
                        parent_pid=0, ranges=((0, 2), (2, 4)))),
    sm.Hello(1, 2, 4242, "ws-b", sm.versions()), sm.Ready(1, 4242, "ws-b", "cpu"), sm.Loaded(1, 3),
    sm.ArenaFilled(0, 1 << 20, 1 << 19, "half"), sm.Note(0, "r", "CUDA graphs captured"), sm.Waiting(1, 0),
    sm.Computed(1, 2), sm.Returned(0, 2), sm.PrefillDone(1), sm.Token(1, 2, 99), sm.RunClosed(0), sm.Pong(0, 123),
    sm.Measured(0, ((256, 0.5), (1024, 1.25)), 1e-9, 2e-5), sm.ExpertReport(0, "r", {"hits": 3, "gbs": 1.5}),
    sm.Failure(1, 2, None, "ValueError", "boom", "Traceback ..."),
    StageEvent("r", 1, "cpu", 2, "compute", 10, 20, tokens=16, nbytes=0, note="x"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_each_message_round_trips_through_the_wire_codec(msg):
    assert type(msg).__name__ in wire.MESSAGE_TYPES
    assert wire.decode(wire.encode(msg)) == msg


def test_every_message_class_of_the_module_has_an_example():
    classes = {c for c in vars(sm).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
               and c.__module__ == sm.__name__}
    assert classes == {type(m) for m in EXAMPLES} - {StageEvent}


def test_a_prefill_done_carries_the_digest_and_logits_as_arrays():
    last = np.arange(8, dtype=np.float32)
    got = wire.decode(wire.encode(sm.PrefillDone(1, "ab" * 16, last, None)))
    assert got.digest == "ab" * 16 and got.logits is None and np.array_equal(got.last_logits, last)


def test_the_protocol_version_travels_in_every_hello():
    assert sm.versions()["protocol"] == str(sm.PROTOCOL)
    with pytest.raises(ValueError, match="malformed"):
        sm.Hello(1, 2, "pid", "host", {}).check()
