"""strata.optim.AdamW / Adam against torch.optim (foreach=False) on the CPU (simulated device):
30 steps under every policy, with an LR scheduler, with two param groups, with the model attached
and every role streamed; state dicts both ways; errors; no leaks."""

import re

import pytest
import torch

import strata
from models import POLICIES, Mlp, assert_bitwise, assert_close, batch, params_of, train


def torch_run(steps=30, sched=False, groups=False, cls=torch.optim.AdamW):
    model = Mlp()
    params = two_groups(model) if groups else model.parameters()
    opt = cls(params, lr=1e-3, weight_decay=0.05, foreach=False)
    s = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5) if sched else None
    losses = train(model, opt, steps, sched=s)
    return losses, params_of(model)


def two_groups(model):
    return [
        {"params": list(model.inp.parameters()) + list(model.mid.parameters())},
        {
            "params": list(model.out.parameters()),
            "lr": 3e-3,
            "weight_decay": 0.0,
            "betas": (0.8, 0.99),
        },
    ]


def strata_run(policy, steps=30, sched=False, groups=False, cls=strata.optim.AdamW, **kw):
    model = Mlp()
    params = two_groups(model) if groups else model.parameters()
    opt = cls(params, lr=1e-3, weight_decay=0.05, policy=policy, **kw)
    s = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5) if sched else None
    losses = train(model, opt, steps, sched=s)
    out = params_of(model)
    assert opt.close() == []
    # The model works as an ordinary torch model after close.
    model(batch(0)[0]).sum().backward()
    return losses, out


@pytest.mark.parametrize("sched,groups", [(False, False), (True, False), (False, True)])
def test_matches_torch_under_every_policy_and_bitwise_across_policies(sched, groups):
    want_losses, want_params = torch_run(sched=sched, groups=groups)
    first = None
    for policy in POLICIES:
        losses, params = strata_run(policy, sched=sched, groups=groups)
        assert_close([torch.tensor(losses)], [torch.tensor(want_losses)])
        assert_close(params, want_params)
        if first is None:
            first = (losses, params)
        else:
            assert losses == first[0]
            assert_bitwise(params, first[1])


def test_adam_with_coupled_weight_decay_and_amsgrad():
    model = Mlp()
    ref = torch.optim.Adam(
        model.parameters(), lr=1e-3, weight_decay=0.05, amsgrad=True, foreach=False
    )
    want = train(model, ref, 20)
    model2 = Mlp()
    opt = strata.optim.Adam(
        model2.parameters(),
        lr=1e-3,
        weight_decay=0.05,
        amsgrad=True,
        policy="layer_prefetch",
        layer_bytes=2048,
    )
    got = train(model2, opt, 20)
    assert_close([torch.tensor(got)], [torch.tensor(want)])
    assert_close(params_of(model2), params_of(model))
    assert opt.close() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_attached_model_with_every_role_streamed(policy):
    _, want_params = torch_run()
    model = Mlp()
    rt = strata.Runtime(policy=policy, roles="all", device="simulated")
    layers = strata.attach(model, rt)
    assert layers == [model.inp, model.mid, model.out] and rt.num_layers == 3  # act: none
    opt = strata.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, runtime=rt)
    train(model, opt, 30)
    assert_close(params_of(model), want_params)
    stats = rt.memory_stats()
    assert "gpu.allocated_bytes.current" in stats and "pinned_host.reserved_bytes.peak" in stats
    assert "gpu" in rt.memory_summary()
    assert set(rt.stats()) >= {"migrated_bytes_h2d", "h2d_gbps", "prefetch_stall_ms"}
    opt.close()
    assert rt.close() == []


def overlap_run(policy, attach, overlap, max_grad_norm, steps=12):
    """Trains Mlp with clipping inside the optimizer; returns losses, norms, parameters, redos."""
    model = Mlp()
    if attach:  # the attach hooks say where backward is; every role streams
        rt = strata.Runtime(policy=policy, roles="all", device="simulated", overlap=overlap)
        strata.attach(model, rt)
        kw = dict(runtime=rt)
    else:  # the parameters' post-accumulate-grad hooks say it; layers of about 1 KiB
        kw = dict(policy=policy, overlap=overlap, layer_bytes="1KiB")
    opt = strata.optim.AdamW(
        model.parameters(), lr=1e-3, weight_decay=0.05, max_grad_norm=max_grad_norm, **kw
    )
    norms = []
    losses = []
    for step in range(steps):
        losses += train(model, opt, 1, start=step)
        norms.append(float(opt.last_grad_norm))
    out = params_of(model), opt.steps_redone
    assert opt.close() == []
    if attach:
        assert rt.close() == []
    return losses, norms, *out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("attach", [False, True], ids=["params", "attached"])
def test_stepping_in_backward_is_bitwise_the_step_after_it(policy, attach):
    _, norms, _, _ = overlap_run(policy, attach, "none", 1e9)
    # A threshold among the steps' norms: clipping triggers on some steps and not on others.
    clip = sorted(norms)[len(norms) // 2]
    want_losses, want_norms, want_params, redone = overlap_run(policy, attach, "none", clip)
    assert redone == 0
    losses, got_norms, params, redone = overlap_run(policy, attach, "backward", clip)
    assert losses == want_losses and got_norms == want_norms
    assert_bitwise(params, want_params)
    assert 0 < redone < len(norms)


@pytest.mark.parametrize("policy", POLICIES)
def test_stepping_in_backward_refuses_a_backward_run_again_with_no_forward_between(policy):
    model = Mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = strata.optim.AdamW(
        model.parameters(), lr=1e-3, weight_decay=0.05, policy=policy, overlap="backward"
    )
    x, y = batch(0)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    # No forward came between, so the step could not be taken back before the second backward.
    with pytest.raises(RuntimeError, match="accumulated again after it was stepped in backward"):
        loss.backward()
    # What the first backward stepped is taken back, and training goes on from there: as a run
    # that never had the failed backward.
    assert_bitwise([p.detach() for p in model.parameters()], before)
    losses = train(model, opt, 3)
    assert opt.close() == []
    want_model = Mlp()
    want_opt = strata.optim.AdamW(
        want_model.parameters(), lr=1e-3, weight_decay=0.05, policy=policy, overlap="backward"
    )
    assert losses == train(want_model, want_opt, 3)
    assert_bitwise(params_of(model), params_of(want_model))
    assert want_opt.close() == []


def test_overlap_and_clipping_arguments_are_checked():
    with pytest.raises(ValueError, match="max_grad_norm"):
        strata.optim.AdamW(Mlp().parameters(), policy="keep_on_gpu", max_grad_norm=0.0)
    with pytest.raises(ValueError, match="overlap"):
        strata.optim.AdamW(Mlp().parameters(), policy="keep_on_gpu", overlap="sideways")
    rt = strata.Runtime(policy="keep_on_gpu", device="simulated")
    with pytest.raises(ValueError, match="made with overlap='none'"):
        strata.optim.AdamW(Mlp().parameters(), runtime=rt, overlap="backward")
    rt.close()


class TwoRoots(torch.nn.Module):
    """Two embeddings summed into a block: their backward passes run together, after the block's,
    and their inputs need no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.pos = torch.nn.Embedding(4, 8)
        self.block = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(torch.relu(self.block(x)))


def test_attach_hooks_begin_every_layers_backward_before_autograd_reaches_it():
    model = TwoRoots()
    rt = strata.Runtime(policy="layer_prefetch", roles="all", device="simulated")
    strata.attach(model, rt)
    events = []
    for name in ("_before_forward", "_before_backward", "_after_backward"):
        real = getattr(rt, name)

        def logged(layer, real=real, name=name):
            events.append((name, layer))
            real(layer)

        setattr(rt, name, logged)
    grads_seen = {}

    def seen(layer):
        def hook(grad):
            grads_seen.setdefault(layer, len(events))

        return hook

    for layer, module in enumerate([model.embed, model.pos, model.block, model.head]):
        module.weight.register_hook(seen(layer))

    opt = strata.optim.AdamW(model.parameters(), lr=1e-3, runtime=rt)
    tokens = torch.randint(0, 16, (2, 4))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    began = {layer: i for i, (name, layer) in enumerate(events) if name == "_before_backward"}
    assert set(began) == {0, 1, 2, 3}, events
    # Each layer's backward began before autograd computed its weight's gradient.
    for layer, seen in grads_seen.items():
        assert began[layer] < seen, (layer, events)
    assert [e for e in events if e[0] == "_before_forward"] == [
        ("_before_forward", i) for i in range(4)
    ]
    opt.close()
    assert rt.close() == []


@pytest.mark.parametrize("direction", ["torch_to_strata", "strata_to_torch"])
def test_state_dict_round_trip_with_torch(direction):
    # Ten steps by one, the state dict into the other, ten more steps: as twenty steps of torch.
    _, want = torch_run(steps=20)
    model = Mlp()
    first_cls = torch.optim.AdamW if direction == "torch_to_strata" else strata.optim.AdamW
    kw = {"foreach": False} if first_cls is torch.optim.AdamW else {"policy": "layer_prefetch"}
    first = first_cls(model.parameters(), lr=1e-3, weight_decay=0.05, **kw)
    train(model, first, 10)
    sd = first.state_dict()
    assert set(sd["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["exp_avg"].device.type == "cpu"
    if first_cls is strata.optim.AdamW:
        first.close()
    second_cls = strata.optim.AdamW if first_cls is torch.optim.AdamW else torch.optim.AdamW
    kw = {"foreach": False} if second_cls is torch.optim.AdamW else {"policy": "layer_prefetch"}
    second = second_cls(model.parameters(), lr=5.0, weight_decay=0.0, **kw)
    second.load_state_dict(sd)
    assert second.param_groups[0]["lr"] == 1e-3
    train(model, second, 10, start=10)
    assert_close(params_of(model), want)
    if second_cls is strata.optim.AdamW:
        assert second.close() == []


def test_state_dict_refuses_a_mismatched_one():
    model = Mlp()
    opt = strata.optim.AdamW(model.parameters(), policy="bulk")
    other = torch.optim.AdamW(list(model.parameters())[:2])
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        opt.load_state_dict(other.state_dict())
    opt.close()


def raises_exactly(kind, message):
    """pytest.raises for `kind` whose message is `message`, whole."""
    return pytest.raises(kind, match=f"^{re.escape(message)}$")


def test_errors_carry_the_runtimes_message():
    model = Mlp()
    with raises_exactly(
        ValueError,
        "INVALID_ARGUMENT: unknown policy 'fastest'; valid policies: bulk, hybrid, keep_on_gpu, "
        "layer_prefetch (policy chosen by RuntimeOptions::policy)",
    ):
        strata.optim.AdamW(model.parameters(), policy="fastest")
    with raises_exactly(
        ValueError,
        "gpu_budget: INVALID_ARGUMENT: cannot parse a byte size from 'lots': expected e.g. "
        "4096, 64KiB, 8GiB",
    ):
        strata.Runtime(gpu_budget="lots")
    with raises_exactly(ValueError, "gpu_budget: expected a positive number of bytes, got -5"):
        strata.Runtime(gpu_budget=-5)
    with raises_exactly(ValueError, "Invalid learning rate: -1"):
        strata.optim.AdamW(model.parameters(), lr=-1)
    with raises_exactly(ValueError, "Invalid beta parameter at index 0: 1.5"):
        strata.optim.AdamW(model.parameters(), betas=(1.5, 0.9))
    with raises_exactly(
        ValueError, "prefetch_depth: expected an int >= 0 (0: no prefetch), got -1"
    ):
        strata.Runtime(prefetch_depth=-1)
    with raises_exactly(
        ValueError,
        "INVALID_ARGUMENT: unknown role 'weights'; valid roles: parameter, gradient, "
        "optimizer_state, other (an optimizer's states move together as optimizer_state; See "
        "Note [Roles] in runtime/tensor.h)",
    ):
        strata.Runtime(roles="weights")
    with raises_exactly(
        torch.OutOfMemoryError,
        "RESOURCE_EXHAUSTED: register_tensor 'group0.param0': out of memory in tier gpu: tried to "
        "allocate 2.00 KiB (2048 bytes asked); reserved 0 B, allocated 0 B, budget 4.00 KiB, "
        "largest free block 0 B; a new segment of 2.00 MiB would pass the budget",
    ):
        strata.optim.AdamW(model.parameters(), policy="keep_on_gpu", gpu_budget=4096)
    rt = strata.Runtime(device="simulated")
    with raises_exactly(ValueError, "strata.attach: layers must be modules, got str"):
        strata.attach(model, rt, layers=["inp"])
    with raises_exactly(ValueError, "strata.attach: a layer given is not a submodule of the model"):
        strata.attach(model, rt, layers=[torch.nn.Linear(2, 2)])
    assert rt.close() == []
    with raises_exactly(RuntimeError, "strata.Runtime: this runtime was closed"):
        rt.offload_all()
    # The failed optimizers left nothing bound: the model trains with torch's AdamW.
    train(model, torch.optim.AdamW(model.parameters()), 2)


def test_a_forward_while_offloaded_raises_and_training_goes_on_after_reload():
    _, want = torch_run(steps=4)
    model = Mlp()
    rt = strata.Runtime(policy="layer_prefetch", roles="all", device="simulated")
    strata.attach(model, rt)
    opt = strata.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, runtime=rt)
    train(model, opt, 2)
    rt.offload_all()
    with raises_exactly(
        RuntimeError,
        "FAILED_PRECONDITION: begin_step: tensors are offloaded (offload_all); call reload_all "
        "first",
    ):
        model(torch.randn(4, model.inp.in_features))
    rt.reload_all()
    train(model, opt, 2, start=2)
    assert_close(params_of(model), want)
    opt.close()
    assert rt.close() == []


def test_gpu_budget_strings():
    assert strata.parse_bytes("8GiB") == 8 * 2**30
    assert strata.parse_bytes("512 MB") == 512 * 10**6
    assert strata.parse_bytes(1234) == 1234
    assert strata.parse_bytes(None) is None
    # One parser with strata-train's flags: K, M, G and T are powers of two there and here.
    assert strata.parse_bytes("1.5g") == 3 * 2**29
    assert strata.parse_bytes(" 64 KiB ") == 64 * 1024
    with pytest.raises(ValueError, match="layer_bytes: INVALID_ARGUMENT: unknown byte unit 'ps'"):
        strata.parse_bytes("8ps", "layer_bytes")
    with pytest.raises(ValueError, match="expected a positive number of bytes, got '0'"):
        strata.parse_bytes("0")
    with pytest.raises(ValueError, match="expected bytes or a size such as '8GiB', got 1.5"):
        strata.parse_bytes(1.5)


def test_phase_switch_keeps_training_identical():
    _, want = torch_run(steps=12)
    model = Mlp()
    opt = strata.optim.AdamW(
        model.parameters(), lr=1e-3, weight_decay=0.05, policy="layer_prefetch"
    )
    train(model, opt, 6)
    opt.runtime.offload_all()
    assert opt.runtime.offloaded
    assert opt.runtime.stats()["gpu_reserved_bytes"] == 0
    opt.runtime.reload_all()
    train(model, opt, 6, start=6)
    assert_close(params_of(model), want)
    assert opt.close() == []


def test_the_device_is_named_as_torch_names_it():
    # "cuda:N" as torch writes it (See Note [One CUDA device a runtime] in runtime/runtime.h);
    # anything else is refused naming the forms; a CUDA device where there is none, naming why.
    with pytest.raises(ValueError, match=r"unknown device 'cuda:x'; .* cuda:N \(CUDA device N\)"):
        strata.Runtime(device="cuda:x")
    if torch.cuda.device_count() == 0:
        with pytest.raises(RuntimeError, match="no CUDA device is visible"):
            strata.Runtime(device="cuda:1")
