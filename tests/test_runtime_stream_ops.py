"""StreamOps (the located install's stream ordering through the driver API) on CUDA, marker `gpu`: its records are
torch's events' own records (query, synchronize, elapsed_time see them), its waits order one stream after another,
and its current stream is torch's."""

import pytest
import torch

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 200_000_000  # ~0.1 s of `torch.cuda._sleep` on an H200: long enough to see a record pending


@pytest.fixture
def ops():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tierstore.runtime.stream_ops import StreamOps

    return StreamOps(torch.device("cuda", torch.cuda.current_device()))


def test_current_is_torchs_current_stream(ops):
    assert ops.current() == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert ops.current() == side.cuda_stream != torch.cuda.default_stream().cuda_stream


def test_handle_creates_the_event_once(ops):
    event = torch.cuda.Event()
    assert not event.cuda_event  # torch creates an event at its first record
    handle = ops.handle(event)
    assert handle and event.cuda_event == handle
    assert ops.handle(event) == handle
    event.synchronize()
    assert event.query()


def test_a_record_is_the_torch_events_last(ops):
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_handle, end_handle = ops.handle(start), ops.handle(end)
    ops.record(start_handle, stream.cuda_stream)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    ops.record(end_handle, stream.cuda_stream)
    assert not end.query()  # pending behind the sleep: the record torch sees is this one
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) > 1.0  # ms: the sleep lies between the two records


def test_wait_orders_a_stream_after_an_event(ops):
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    source = torch.zeros(1 << 20, device="cuda")
    target = torch.full_like(source, -1.0)  # poisoned
    torch.cuda.synchronize()
    written = torch.cuda.Event()
    handle = ops.handle(written)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES)
        source.fill_(7.0)
    ops.record(handle, producer.cuda_stream)
    ops.wait(consumer.cuda_stream, handle)
    with torch.cuda.stream(consumer):
        target.copy_(source)  # without the wait this runs during the sleep and copies zeros
    torch.cuda.synchronize()
    assert torch.equal(target, torch.full_like(source, 7.0))

