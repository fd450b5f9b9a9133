"""SpanBatcher: spans written in batches on its thread, flush waits for them, a failure loses its batch alone."""

import threading

import pytest

from agl_core.data import Span
from agl_core.rollout.span_batcher import SpanBatcher


def span(i: int) -> Span:
    return Span(rollout_id="r", attempt_id="1", sequence_id=i, kind="annotation")


def test_spans_are_written_in_batches_and_flush_waits_for_them():
    gate, batches = threading.Event(), []

    def write(spans):
        gate.wait(10)  # the first batch holds the thread while more spans queue up
        batches.append([s.sequence_id for s in spans])

    batcher = SpanBatcher(write, str, name="test-batcher", batch_size=3, max_pending=100)
    batcher.start()
    batcher.put([span(0)])
    batcher.put([span(i) for i in range(1, 8)])
    gate.set()
    batcher.flush()
    assert sorted(i for batch in batches for i in batch) == list(range(8))
    assert all(len(batch) <= 3 for batch in batches) and len(batches) >= 3
    batcher.stop(timeout_s=10)
    assert not batcher.is_alive()


def test_a_failed_write_loses_its_batch_alone_and_the_next_batch_is_written():
    written, lost = [], []

    def write(spans):
        if spans[0].sequence_id == 1:
            raise OSError("disk full")
        written.extend(s.sequence_id for s in spans)

    batcher = SpanBatcher(write, lambda spans, error: lost.append(([s.sequence_id for s in spans], str(error))),
                          name="test-batcher", batch_size=1, max_pending=100)
    batcher.start()
    batcher.put([span(0)])
    batcher.flush()
    batcher.put([span(1)])
    batcher.flush()  # returns: the span is lost, and the batcher said so
    assert lost == [([1], "disk full")]
    batcher.put([span(2)])
    batcher.flush()
    batcher.stop(timeout_s=10)
    assert written == [0, 2]


def test_a_report_that_fails_does_not_stop_the_thread():
    written = []

    def write(spans):
        if spans[0].sequence_id == 0:
            raise OSError("disk full")
        written.extend(s.sequence_id for s in spans)

    def lost(spans, error):
        raise RuntimeError("the report failed too")

    batcher = SpanBatcher(write, lost, name="test-batcher", batch_size=1, max_pending=100)
    batcher.start()
    batcher.put([span(0), span(1)])
    batcher.flush()
    batcher.stop(timeout_s=10)
    assert written == [1]


def test_stop_writes_what_is_queued_first():
    written = []
    batcher = SpanBatcher(lambda spans: written.extend(s.sequence_id for s in spans), str, name="test-batcher",
                          batch_size=2, max_pending=100)
    batcher.start()
    batcher.put([span(i) for i in range(5)])
    batcher.stop(timeout_s=10)
    assert written == [0, 1, 2, 3, 4]


def test_carry_sends_the_waiting_spans_with_the_callers_request_and_requeues_them_on_failure():
    gate, written = threading.Event(), []

    def write(spans):
        gate.wait(10)  # holds the thread with the first span while the others wait in the queue
        written.extend(s.sequence_id for s in spans)

    batcher = SpanBatcher(write, str, name="test-batcher", batch_size=2, max_pending=100)
    batcher.start()
    batcher.put([span(0)])
    while batcher.pending.qsize():  # the thread took span 0 and waits at the gate
        pass
    batcher.put([span(1), span(2), span(3)])
    carried = []
    assert batcher.carry(lambda spans: carried.extend(s.sequence_id for s in spans) or "answer") == "answer"
    assert carried == [1, 2]  # up to batch_size

    def refused(spans):
        raise ConnectionError("the service is gone")

    with pytest.raises(ConnectionError):
        batcher.carry(refused)  # span 3 goes back to the queue
    gate.set()
    batcher.flush()
    assert sorted(written) == [0, 3]
    assert batcher.carry(lambda spans: spans) == []  # nothing waits
    batcher.stop(timeout_s=10)


def test_a_carry_after_the_rest_is_sent_once_the_spans_on_their_way_are_written():
    gate, written, order = threading.Event(), [], []

    def write(spans):
        gate.wait(10)  # span 0 is on its way, held
        written.extend(s.sequence_id for s in spans)
        order.append("written")

    batcher = SpanBatcher(write, str, name="test-batcher", batch_size=8, max_pending=100)
    batcher.start()
    batcher.put([span(0)])
    while batcher.pending.qsize():  # the thread took span 0 and waits at the gate
        pass
    batcher.put([span(1), span(2)])
    threading.Timer(0.2, gate.set).start()

    def send(spans):
        order.append(("sent", [s.sequence_id for s in spans]))
        return written[:]

    assert batcher.carry(send, after_the_rest=True) == [0]  # sent after span 0 was written, carrying 1 and 2
    assert order == ["written", ("sent", [1, 2])]
    batcher.flush()  # the carried spans count as written
    batcher.stop(timeout_s=10)
