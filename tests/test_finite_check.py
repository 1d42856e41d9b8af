"""The save's NaN/Inf check: every tensor of the state screened, with one finiteness check for all of them.

``finite.first_non_finite`` sums each parameter and Adam moment and checks all the sums of a device and dtype
at once (one host sync, not one per tensor); a NaN or Inf anywhere must still be found, the first one in
order named, and finite values whose sums overflow must still pass.
"""

from __future__ import annotations

import torch

from verl.utils.checkpoint import finite


def _model_and_adam() -> tuple[list[torch.nn.Module], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6)))
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    adam.step()
    return [model], adam


def test_every_nan_or_inf_is_found_and_the_first_named():
    model, adam = _model_and_adam()
    names = [name for name, _ in finite.named_state_tensors(model, adam)]
    assert finite.first_non_finite(model, adam) is None
    assert len(names) == 48 and any("exp_avg_sq" in name for name in names)  # 12 parameters, 3 Adam tensors each
    for position in range(len(names)):
        tensors = dict(finite.named_state_tensors(model, adam))
        first, later = tensors[names[position]], tensors[names[(position + 7) % len(names)]]
        saved = first.detach().clone(), later.detach().clone()
        with torch.no_grad():
            first.view(-1)[-1] = float("nan") if position % 2 else float("-inf")
            if position + 7 < len(names):  # a later one too: the first in order is the one named
                later.view(-1)[0] = float("inf")
            assert finite.first_non_finite(model, adam) == names[position]
            first.copy_(saved[0])
            later.copy_(saved[1])
    assert finite.first_non_finite(model, adam) is None


def test_finite_values_whose_sums_overflow_pass():
    model, adam = _model_and_adam()
    with torch.no_grad():
        for param in model[0].parameters():
            param.fill_(torch.finfo(torch.float32).max / 4)
    assert finite.first_non_finite(model, adam) is None
    with torch.no_grad():
        model[0][5].bias[3] = float("nan")
    assert finite.first_non_finite(model, adam) == "5.bias"
