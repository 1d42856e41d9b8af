"""The host copy a ``background_write`` fork reads: which tensors it covers, and what installing it does."""

from __future__ import annotations

import torch

from verl.utils.checkpoint.host_copy import HostCopy, state_tensors


def _model_and_optimizer() -> tuple[list, torch.optim.Optimizer]:
    model = [torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))]
    optimizer = torch.optim.Adam(model[0].parameters())
    model[0](torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_every_tensor_a_save_reads_is_covered_once():
    model, optimizer = _model_and_optimizer()
    covered = list(state_tensors(model, optimizer))
    expected = [*model[0].parameters(), *model[0].buffers(), *(t for s in optimizer.state.values() for t in s.values())]
    assert len(covered) == len({id(t) for t in covered}) == len(expected)
    assert {id(t) for t in covered} == {id(t) for t in expected}


def test_state_in_host_memory_is_not_copied():
    model, optimizer = _model_and_optimizer()
    assert HostCopy.take(model, optimizer).pairs == []


def test_installing_points_each_tensor_at_its_copy_and_keeps_what_it_held():
    live, moment = torch.nn.Parameter(torch.zeros(3)), torch.zeros(2)
    copies = HostCopy([(live, torch.ones(3)), (moment, torch.full((2,), 2.0))])
    held = live.data
    copies.install()
    assert torch.equal(live, torch.ones(3)) and torch.equal(moment, torch.full((2,), 2.0))
    assert isinstance(live, torch.nn.Parameter)
    assert copies.kept[0].data_ptr() == held.data_ptr() and torch.equal(held, torch.zeros(3))  # still referenced, untouched
