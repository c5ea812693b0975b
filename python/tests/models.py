"""Small models and a training loop shared by the tests."""

import torch
from strata._readback import Iteration

POLICIES = ["keep_on_gpu", "bulk", "layer_prefetch"]


class Mlp(torch.nn.Module):
    """Four layers (top-level children), so layer_prefetch has layers to stream."""

    def __init__(self, width=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, width)
        self.act = torch.nn.Tanh()
        self.mid = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, 4)

    def forward(self, x):
        return self.out(self.act(self.mid(self.act(self.inp(x)))))


def batch(step, device="cpu"):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    return x.to(device), y.to(device)


def train(model, opt, steps, start=0, sched=None, device="cpu"):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def params_of(model):
    return [p.detach().cpu().clone() for p in model.parameters()]


def assert_close(a, b, rel=1e-6):
    """Each tensor within `rel` of its reference, relative in the 2-norm: strata computes torch's
    fused kernel's expression and torch.optim's for-loop AdamW another (lerp, float32 scalars),
    so single elements near zero may differ by more than rel of themselves."""
    for x, y in zip(a, b):
        worst = ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-12)).item()
        assert worst <= rel, f"relative difference {worst} > {rel}"


def assert_bitwise(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def example(name):
    """examples/<name>.py of the repository, imported as a module."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeClock:
    """Iteration times by where the step ran, as strata._readback.StepClock gives them, but fixed
    (or taken in turn from a list, the last one repeated); `parts`: the backward and the step of
    each iteration stepped after backward, in ms (None: not split). Each iteration is done `lag`
    marks after its own (0: at once), as a GPU's events are read back a step or two late."""

    def __init__(self, ms: dict, parts: tuple | None = None, lag: int = 0) -> None:
        self.ms, self.parts, self.lag, self.started, self.out = ms, parts, lag, False, []

    def begin_backward(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def forget_backward(self) -> None:
        pass

    def mark(self, label) -> None:
        if self.started and label is not None:
            ms = self.ms[label]
            if isinstance(ms, list):
                ms = ms.pop(0) if len(ms) > 1 else ms[0]
            split = self.parts if label == "after" and self.parts else (None, None)
            self.out.append(Iteration(label, ms, *split))
        self.started = True

    def pending(self, label) -> int:
        return sum(1 for it in self.out[max(0, len(self.out) - self.lag) :] if it.label == label)

    def done(self) -> list:
        ready = max(0, len(self.out) - self.lag)
        out, self.out = self.out[:ready], self.out[ready:]
        return out
