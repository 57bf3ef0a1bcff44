"""Built-in models: exact parameter counts and a real CPU training step for the tiny ones."""

from __future__ import annotations

import pytest
import torch

from hetpipe import models
from hetpipe.errors import ConfigError


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied weights


@pytest.mark.parametrize("name, expected", [("gpt2-small", 124_439_808), ("resnet50", 25_557_032),
                                            ("llama-7b", 6_738_415_616)])
def test_parameter_counts_exact(name, expected):
    model, _ = models.build(name, device="meta")
    assert _count(model) == expected


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-tiny", "resnet-tiny", "unet-tiny"])
def test_tiny_models_train_on_cpu(name):
    torch.manual_seed(0)
    model, inputs = models.build(name, device="cpu")
    out = model(*inputs)
    loss = models.loss_fn(name)(out, models.example_targets(name, inputs))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_unknown_model_lists_close_match():
    with pytest.raises(ConfigError, match="gpt2-small"):
        models.build("gpt2-smal")


def test_unknown_model_lists_every_built_in_model():
    """The hf-* models are built-in too (`hetpipe models` lists them): the error names them all."""
    with pytest.raises(ConfigError) as info:
        models.build("no-such-model")
    message = str(info.value)
    assert [s.name for s in models.list_models() if s.name not in message] == []
    assert "hf-gpt2-tiny" in message and "`hetpipe models`" in message and "\n" not in message
    with pytest.raises(ConfigError, match="did you mean 'hf-bert-tiny'"):
        models.build("hf-bert-tinny")
