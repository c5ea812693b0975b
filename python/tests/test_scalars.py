"""strata.read_scalars against .item(): every dtype, None, errors; on the GPU, values written by
work still queued on torch's current stream (the default one or another), read while a large copy
to the host runs on a side stream, and CUDA scalars on two devices refused."""

import math

import pytest
import torch

import strata

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def scalars(device):
    out = []
    for dtype in DTYPES:
        value = True if dtype == torch.bool else 3.140625 if dtype.is_floating_point else -7
        out.append(torch.tensor(value, dtype=dtype, device=device))
    out.append(torch.tensor([0.1], dtype=torch.float64, device=device))  # one element, 1-D
    out.append(torch.tensor(float("-inf"), device=device))
    out.append((torch.ones(3, device=device, requires_grad=True) * 2).sum())  # a loss in a graph
    return out


def test_values_equal_item_on_cpu():
    ts = scalars("cpu")
    assert strata.read_scalars(*ts) == [float(t.item()) for t in ts]
    got = strata.read_scalars(None, torch.tensor(2.5), None)
    assert math.isnan(got[0]) and got[1] == 2.5 and math.isnan(got[2])
    assert strata.read_scalars() == []


def test_errors():
    with pytest.raises(RuntimeError, match="2 elements"):
        strata.read_scalars(torch.tensor(1.0), torch.zeros(2))
    with pytest.raises(TypeError, match="argument 1 is a float"):
        strata.read_scalars(torch.tensor(1.0), 2.0)


@pytest.mark.gpu
def test_values_equal_item_on_gpu():
    ts = scalars("cuda")
    assert strata.read_scalars(*ts) == [float(t.item()) for t in ts]
    nan = strata.read_scalars(torch.tensor(float("nan"), device="cuda"), None)
    assert math.isnan(nan[0]) and math.isnan(nan[1])
    # CPU and CUDA scalars in one call.
    assert strata.read_scalars(torch.tensor(1.5), ts[0]) == [1.5, 3.140625]


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_reads_after_queued_work(side_stream):
    # A value computed by work long enough to be still queued when the read starts: the read
    # must wait for it on the stream it was queued on, not read a stale slot.
    a = torch.randn(4096, 4096, device="cuda")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for k in range(1, 6):
            x = a
            for _ in range(8):
                x = x @ a / 64.0
            value = x.sum() + k
            expected = value.item()
            assert strata.read_scalars(value) == [expected]


@pytest.mark.gpu
def test_reads_while_a_copy_to_the_host_runs():
    # The case read_scalars exists for: a large copy to pinned memory on another stream (as
    # strata's write-backs are) while the loss is read; the value is right either way.
    src = torch.randn(256 << 20, device="cuda")  # 1 GiB
    dst = torch.empty(src.shape, pin_memory=True)
    copies = torch.cuda.Stream()
    copies.wait_stream(torch.cuda.current_stream())
    loss = (src[:1000] * 2).sum()
    with torch.cuda.stream(copies):
        dst.copy_(src, non_blocking=True)
    assert strata.read_scalars(loss) == [loss.item()]
    copies.synchronize()
    assert torch.equal(dst[:10], src[:10].cpu())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_devices_refused():
    with pytest.raises(RuntimeError, match="read each device's scalars in a call of its own"):
        strata.read_scalars(torch.tensor(1.0, device="cuda:0"), torch.tensor(1.0, device="cuda:1"))
