"""The peft behaviours docs/s3t.md gives as the reasons S3T injects its own adapters.

Checked on the installed peft, so that the page is revisited if they change.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # importing peft (and transformers) takes ~10 s


def _base() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    layers = {"fc": nn.Linear(8, 16), "act": nn.GELU(), "classifier": nn.Linear(16, 3)}
    model = nn.Sequential(OrderedDict(layers))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def test_peft_draws_lora_a_from_the_global_generator() -> None:
    config = peft.LoraConfig(r=2, target_modules=["fc"])
    a = peft.get_peft_model(_base(), config).base_model.model.fc.lora_A["default"]
    b = peft.get_peft_model(_base(), config).base_model.model.fc.lora_A["default"]
    assert not torch.equal(a.weight, b.weight)  # no per-stage generator to pass


def test_activating_a_prefix_of_adapters_makes_all_of_them_trainable() -> None:
    model = peft.get_peft_model(
        _base(),
        peft.LoraConfig(r=2, target_modules=["classifier"]),
        adapter_name="stage1",
    )
    model.add_adapter("stage2", peft.LoraConfig(r=2, target_modules=["fc"]))
    model.base_model.set_adapter(["stage1", "stage2"])
    assert model.base_model.model.classifier.lora_A["stage1"].weight.requires_grad


def test_one_head_per_stage_cannot_be_active_with_a_stack_of_adapters() -> None:
    model = peft.get_peft_model(
        _base(),
        peft.LoraConfig(r=2, target_modules=["fc"], modules_to_save=["classifier"]),
        adapter_name="stage1",
    )
    model.add_adapter(
        "stage2",
        peft.LoraConfig(r=2, target_modules=["fc"], modules_to_save=["classifier"]),
    )
    with pytest.raises(ValueError, match="Only one adapter can be set at a time"):
        model.base_model.set_adapter(["stage1", "stage2"])
