"""The split backward's memoised graph analysis: a graph that differs between micro-batches never
reuses another's analysis, and B + W equal one plain backward on every micro-batch."""

from __future__ import annotations

import copy

import pytest
import torch

from hetpipe.partitioner.capture.graph_shape import analyse, walk
from hetpipe.runtime.execute.split_backward import analysis_cache_info, backward_input, backward_weight

RTOL, ATOL = 1e-6, 1e-7


class Branchy(torch.nn.Module):
    """A data-dependent branch: micro-batches whose first element is positive skip `b` and use `c`
    twice (one group), the others run `a`, `b` and a residual (three groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if float(x[0, 0].detach()) > 0:
            h = self.c(torch.tanh(self.c(x)))
        else:
            h = x + self.b(torch.relu(self.a(self.drop(x))))
        aux = (self.c.weight * 2).sum(0, keepdim=True).expand_as(h)  # reaches no input, shares c.weight
        return h, aux


def _split(net: Branchy, x: torch.Tensor, g: tuple[torch.Tensor, torch.Tensor], seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    outs = net(x)
    dx, pending = backward_input(list(outs), list(g), [x], list(net.parameters()))
    backward_weight(pending, list(net.parameters()))
    return dx[0]


def _plain(net: Branchy, x: torch.Tensor, g: tuple[torch.Tensor, torch.Tensor], seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    torch.autograd.backward(list(net(x)), list(g))
    return x.grad


def test_a_data_dependent_graph_never_reuses_another_micro_batchs_analysis() -> None:
    """Micro-batches alternate between two graphs (and dropout masks differ within one): each
    gets its own analysis, repeats of a graph hit the cache, and input and accumulated parameter
    gradients equal a plain backward after every micro-batch."""
    torch.manual_seed(0)
    net = Branchy().train()
    ref = copy.deepcopy(net)
    signs = [1.0, -1.0, -1.0, 1.0, -1.0, 1.0]
    before = analysis_cache_info()
    for mb, sign in enumerate(signs):
        x = torch.randn(4, 6)
        x[0, 0] = sign * (1.0 + x[0, 0].abs())
        g = (torch.randn(4, 6), torch.randn(4, 6))
        torch.testing.assert_close(_split(net, x, g, seed=mb), _plain(ref, x, g, seed=mb), rtol=RTOL, atol=ATOL)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=f"micro-batch {mb}: {name}")
    after = analysis_cache_info()
    assert after.misses - before.misses <= 2  # at most one analysis per distinct graph (another test may hold one)
    assert after.hits - before.hits >= len(signs) - 2


def test_the_two_branches_have_different_topologies_and_cuts() -> None:
    torch.manual_seed(0)
    net = Branchy().eval()
    params = list(net.parameters())
    shapes = []
    for sign in (1.0, -1.0):
        x = torch.full((2, 6), sign, requires_grad=True)
        nodes, topo = walk(list(net(x)), [x], params)
        shapes.append((topo, analyse(topo)))
    (t_pos, s_pos), (t_neg, s_neg) = shapes
    assert t_pos != t_neg
    names = {n: i for i, (n, _) in enumerate(net.named_parameters())}
    # positive: c twice and the aux output share c.weight: one call; negative: a, b, and c (aux) alone
    assert [g[2] for g in s_pos.groups] == [tuple(sorted((names["c.weight"], names["c.bias"])))]
    assert sorted(g[2] for g in s_neg.groups) == sorted([(names["a.weight"], names["a.bias"]),
                                                         (names["b.weight"], names["b.bias"]), (names["c.weight"],)])


def test_w_accumulates_each_parameter_once_like_a_plain_backward() -> None:
    """Post-accumulate-grad hooks (the replica sync's overlap) fire once per parameter per W, as in
    a plain backward, also for a parameter reached both through the inputs' path and from an output
    that reaches no input (c.weight in the branch with c twice)."""
    torch.manual_seed(0)
    for x in (-torch.rand(3, 6) - 0.1, torch.rand(3, 6) + 0.1):
        net = Branchy().eval()
        ref = copy.deepcopy(net)
        fired: dict[str, list[str]] = {"split": [], "plain": []}
        for key, module in (("split", net), ("plain", ref)):
            for name, p in module.named_parameters():
                p.register_post_accumulate_grad_hook(lambda _p, name=name, key=key: fired[key].append(name))
        g = (torch.randn(3, 6), torch.randn(3, 6))
        _split(net, x, g, seed=0)
        _plain(ref, x, g, seed=0)
        assert sorted(fired["split"]) == sorted(fired["plain"]) and len(set(fired["split"])) == len(fired["split"])


@pytest.mark.parametrize("first_stage", [True, False])
def test_a_stage_without_input_gradients_runs_the_whole_backward_in_w(first_stage: bool) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    ref = copy.deepcopy(lin)
    x = torch.randn(5, 3, requires_grad=not first_stage)
    y = lin(x).pow(2).sum()
    dx, pending = backward_input([y], None, [x], list(lin.parameters()))
    assert lin.weight.grad is None and (dx[0] is None) == first_stage
    backward_weight(pending, list(lin.parameters()))
    ref(x.detach()).pow(2).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=RTOL, atol=ATOL)
