"""Soundness suite of modified BERTs: each converted and verified, or refused by cause.

Every model is a tiny ``transformers`` BERT built from a config with random weights,
then modified the way a user's installed model can differ from its config: swapped
activation modules, class-level patches, global and module hooks, a re-registered
attention function, a patched ``torch`` function, a changed buffer, LayerNorms
without affine parameters, training mode. A converted model is verified on fresh
sequences (not the self-check's): the converted structure run with the source's
functions gives the source's logits. A refused one must name the cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture

transformers = pytest.importorskip("transformers")

from defense_suite.crypto.conversion import ConversionError, HEBert, convert  # noqa: E402
from defense_suite.crypto.conversion.installed import check_installed  # noqa: E402
from defense_suite.crypto.conversion.selfcheck import (  # noqa: E402
    reference_outputs,
    sample_inputs,
)

modeling = transformers.models.bert.modeling_bert
N = 8
NAN_KEY = "bert.encoder.layer.0.output.dense.weight"


def _bert(**overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "vocab_size": 30,
        "hidden_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 12,
        "max_position_embeddings": 12,
        "num_labels": 3,
        "initializer_range": 0.3,
    }
    settings.update(overrides)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification(
            transformers.BertConfig(**settings)
        ).eval()


def _verify(model: Any, he: HEBert) -> float:
    """Largest |source - converted structure with the source's functions| logit."""
    functions = check_installed(
        model, "bert", model.bert.encoder.layer, he.config.head_dim
    )
    ids, mask = sample_inputs(24, N, he.config.vocab_size, 0, seed=99)
    ids_t, mask_t = torch.as_tensor(ids), torch.as_tensor(mask)
    training = model.training
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids_t, attention_mask=mask_t).logits.double()
    model.train(training)
    got = reference_outputs(he, functions, ids_t, mask_t.double())["logits"]
    return float((got - want).abs().max())


# ---------------------------------------------------------------- converted


def _no_affine(model: Any) -> None:
    for layer in model.bert.encoder.layer:
        layer.output.LayerNorm = nn.LayerNorm(8, eps=1e-12, elementwise_affine=False)
    model.bert.embeddings.LayerNorm = nn.LayerNorm(8, eps=1e-12, bias=False)


def _relu_installed(model: Any) -> None:
    model.bert.encoder.layer[1].intermediate.intermediate_act_fn = nn.ReLU()


def _mixed_gelus(model: Any) -> None:
    act = nn.GELU(approximate="tanh")
    model.bert.encoder.layer[1].intermediate.intermediate_act_fn = act


def _no_bias(model: Any) -> None:
    old = model.bert.encoder.layer[0].attention.output.dense
    new = nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight)
    model.bert.encoder.layer[0].attention.output.dense = new


def _training(model: Any) -> None:
    model.train()


CONVERTED: dict[str, tuple[dict[str, Any], Callable[[Any], None], str]] = {
    "LayerNorm without affine parameters": ({}, _no_affine, "absent: 1.0"),
    "ReLU installed, config says gelu": ({}, _relu_installed, "layer 1: torch.nn.ReLU"),
    "nn.GELU(tanh) in one block": ({}, _mixed_gelus, "approximate='tanh'"),
    "gelu_new from the config": ({"hidden_act": "gelu_new"}, lambda m: None, "tanh"),
    "eager attention": ({"attn_implementation": "eager"}, lambda m: None, "self-check"),
    "a Linear without bias": ({}, _no_bias, "dense.bias (absent: 0.0)"),
    "left in training mode": ({}, _training, "self-check"),
    "LayerNorm eps 1e-5": ({"layer_norm_eps": 1e-5}, lambda m: None, "self-check"),
}


@pytest.mark.parametrize("case", list(CONVERTED))
def test_modified_bert_is_converted_faithfully(case: str) -> None:
    overrides, modify, said = CONVERTED[case]
    model = _bert(**overrides)
    modify(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    he, report = convert(model, n_tokens=N)
    assert said in str(report)
    assert report.check is not None
    assert report.check.max_error <= 1e-4
    # the source is left as it was: weights, modes, no hook of ours
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert [m.training for m in model.modules()] == modes
    assert not any(m._forward_hooks for m in model.modules())
    # measured: 3e-7 to 2e-6 on these float32 models
    assert _verify(model, he) < 1e-4
    if case == "LayerNorm eps 1e-5":
        assert he.config.layer_norm_eps == 1e-5


def test_the_verification_is_not_vacuous() -> None:
    """The verification sees a source that no longer matches the converted model."""
    model = _bert()
    he, _ = convert(model, n_tokens=N)
    assert _verify(model, he) < 1e-4
    with torch.no_grad():
        model.bert.encoder.layer[1].intermediate.dense.weight.mul_(2.0)
    assert _verify(model, he) > 1e-2


# ---------------------------------------------------------------- refused


def _tanh_intermediate(model: Any, mp: pytest.MonkeyPatch) -> None:
    model.bert.encoder.layer[0].intermediate.intermediate_act_fn = nn.Tanh()


def _relu_pooler(model: Any, mp: pytest.MonkeyPatch) -> None:
    model.bert.pooler.activation = nn.ReLU()


def _class_patch(model: Any, mp: pytest.MonkeyPatch) -> None:
    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.dense(hidden_states))

    mp.setattr(modeling.BertIntermediate, "forward", forward)


def _global_hook(model: Any, mp: pytest.MonkeyPatch) -> None:
    from torch.nn.modules import module as registry

    def hook(m: nn.Module, args: Any, out: Any) -> Any:
        return out * 1.5 if isinstance(m, nn.Tanh) else None

    mp.setattr(
        registry, "_global_forward_hooks", type(registry._global_forward_hooks)()
    )
    registry.register_module_forward_hook(hook)  # the dict is restored after the test


def _global_pre_hook(model: Any, mp: pytest.MonkeyPatch) -> None:
    from torch.nn.modules import module as registry

    empty = type(registry._global_forward_pre_hooks)()
    mp.setattr(registry, "_global_forward_pre_hooks", empty)
    registry.register_module_forward_pre_hook(lambda m, args: None)


def _module_pre_hook(model: Any, mp: pytest.MonkeyPatch) -> None:
    layer = model.bert.encoder.layer[1].output.dense
    layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,))


def _sdpa_registered(model: Any, mp: pytest.MonkeyPatch) -> None:
    from transformers import AttentionInterface

    def linear_attention(
        module: Any, q: Any, k: Any, v: Any, *a: Any, **kw: Any
    ) -> Any:
        return v.transpose(1, 2).contiguous(), None

    mp.setitem(AttentionInterface._global_mapping, "sdpa", linear_attention)


def _eager_registered(model: Any, mp: pytest.MonkeyPatch) -> None:
    eager = modeling.eager_attention_forward

    def louder(*args: Any, **kw: Any) -> Any:
        out, weights = eager(*args, **kw)
        return 2 * out, weights

    model.config._attn_implementation = "eager"
    mp.setattr(modeling, "eager_attention_forward", louder)


def _scaling(model: Any, mp: pytest.MonkeyPatch) -> None:
    model.bert.encoder.layer[1].attention.self.scaling = 1.0


def _half(model: Any, mp: pytest.MonkeyPatch) -> None:
    model.half()


def _eps_differ(model: Any, mp: pytest.MonkeyPatch) -> None:
    model.bert.encoder.layer[1].output.LayerNorm.eps = 1e-3


def _act_attribute(model: Any, mp: pytest.MonkeyPatch) -> None:
    # a torch function stored where GELUActivation keeps its function: no static
    # rule objects (torch's own code), the self-check does
    model.bert.encoder.layer[1].intermediate.intermediate_act_fn.act = torch.tanh


def _torch_patched(model: Any, mp: pytest.MonkeyPatch) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def skewed(*args: Any, **kw: Any) -> torch.Tensor:
        return 1.25 * sdpa(*args, **kw)

    mp.setattr(torch.nn.functional, "scaled_dot_product_attention", skewed)


def _type_buffer(model: Any, mp: pytest.MonkeyPatch) -> None:
    model.bert.embeddings.token_type_ids.fill_(1)


def _max_norm(model: Any, mp: pytest.MonkeyPatch) -> None:
    model.bert.embeddings.word_embeddings.max_norm = 0.5


def _nan(model: Any, mp: pytest.MonkeyPatch) -> None:
    with torch.no_grad():
        model.bert.encoder.layer[0].output.dense.weight[0, 0] = float("nan")


def _moving_state(model: Any, mp: pytest.MonkeyPatch) -> None:
    layer_norm = torch.nn.functional.layer_norm

    def drifting(x: torch.Tensor, shape: Any, weight: Any = None, *a: Any) -> Any:
        if weight is not None:
            weight.data.add_(0.01)  # a forward that moves the model's own state
        return layer_norm(x, shape, weight, *a)

    mp.setattr(torch.nn.functional, "layer_norm", drifting)


REFUSED: dict[str, tuple[Callable[[Any, pytest.MonkeyPatch], None], str]] = {
    "intermediate activation nn.Tanh (config gelu)": (
        _tanh_intermediate,
        r"layer\.0\.intermediate\.intermediate_act_fn: the installed module is "
        r"torch\.nn\.modules\.activation\.Tanh \(config\.hidden_act = 'gelu'\)",
    ),
    "pooler activation nn.ReLU": (
        _relu_pooler,
        r"bert\.pooler\.activation: the installed module is .*ReLU, not torch\.nn",
    ),
    "class-level patch of BertIntermediate.forward": (
        _class_patch,
        r"BertIntermediate\.forward is patched \(its code is from .*test_convert_sound",
    ),
    "global forward hook": (_global_hook, r"global forward hook is registered"),
    "global forward pre-hook": (_global_pre_hook, r"global forward pre-hook"),
    "module forward pre-hook": (
        _module_pre_hook,
        r"'bert\.encoder\.layer\.1\.output\.dense': it has _forward_pre_hooks",
    ),
    "AttentionInterface['sdpa'] re-registered": (
        _sdpa_registered,
        r"attention registered as 'sdpa' \(transformers' AttentionInterface\) is "
        r".*linear_attention, not transformers' own",
    ),
    "eager attention function replaced in the module": (
        _eager_registered,
        r"registered as 'eager'.*louder",
    ),
    "score scaling changed": (_scaling, r"layer\.1\.attention\.self'.*scaling is 1\.0"),
    "half precision": (_half, r"torch\.float16 model.*model\.float\(\)"),
    "LayerNorm epsilons differ": (_eps_differ, r"epsilons differ"),
    "function attribute swapped (self-check)": (
        _act_attribute,
        r"output at bert\.encoder\.layer\.1\.intermediate differs",
    ),
    "torch sdpa patched (self-check)": (
        _torch_patched,
        r"output at bert\.encoder\.layer\.0\.attention differs",
    ),
    "nn.Embedding with max_norm": (_max_norm, r"word_embeddings'.*max_norm=0\.5"),
    "NaN weight": (_nan, r"layer\.0\.output\.dense\.weight: it holds NaN"),
    "forward moves its own state": (
        _moving_state,
        r"forward changed its own bert\.embeddings\.LayerNorm\.weight \(restored\)",
    ),
    "token-type buffer changed (self-check)": (
        _type_buffer,
        r"output at bert\.embeddings differs",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_modified_bert_is_refused_by_cause(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    modify, cause = REFUSED[case]
    model = _bert()
    with torch.no_grad():
        clean = model(input_ids=torch.full((1, N), 3)).logits
    modify(model, monkeypatch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConversionError, match=cause):
        convert(model, n_tokens=N)
    after = model.state_dict()  # a refusal leaves the source as it was
    assert all(torch.equal(v, after[k]) for k, v in state.items() if k != NAN_KEY)
    assert not any(m._forward_hooks for m in model.modules())
    if case.endswith("(self-check)") or "nn.Tanh" in case or "ReLU" in case:
        with torch.no_grad():  # and the modification does move the logits
            moved = model(input_ids=torch.full((1, N), 3)).logits
        assert float((moved - clean).abs().max()) > 1e-3


def test_a_torch_mode_is_refused() -> None:
    from torch.overrides import TorchFunctionMode

    class Louder(TorchFunctionMode):
        def __torch_function__(
            self, f: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = f(*args, **(kwargs or {}))
            return out * 1.01 if f is torch.tanh else out

    model = _bert()
    with Louder(), pytest.raises(ConversionError, match="torch function or dispatch"):
        convert(model, n_tokens=N)


def test_check_ids_are_the_users_and_bad_ids_are_named() -> None:
    model = _bert()
    ids, mask = sample_inputs(5, N, 30, 0, seed=3)
    he, report = convert(model, n_tokens=N, check_ids=ids, check_mask=mask)
    assert report.check is not None
    assert report.check.sequences == 5
    bad = np.full((2, N), 4)
    bad[1, 3] = -3
    with pytest.raises(ValueError, match=r"token id -3 \(row 1, position 3\)"):
        he.check_ids(bad)
    bad[1, 3] = 30
    with pytest.raises(ValueError, match=r"token id 30 .*ids 0 to 29"):
        he.check_ids(bad)
    with pytest.raises(ValueError, match="token id 31"):
        convert(model, n_tokens=N, check_ids=np.full((1, N), 31))
