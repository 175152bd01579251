"""ShieldedModule under torch's own tools, with broken models, and its seeding default.

``torch.compile`` must answer exactly as eager; ``torch.jit.trace`` and
``torch.jit.script`` must refuse at trace / script time (a traced shield would return
the example input's answers for every input); a model that answers NaN or inf is
refused by name; the wrappers answer with input-hash seeding unless told otherwise.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from defenses.ssd import StealthyShield
from defenses.ssd.torch import ShieldedCallable, ShieldedModule, TorchToolError


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _shield(k: int = 5, seeding: str = "random", seed: int = 3) -> StealthyShield:
    rng = np.random.default_rng(0)
    val = rng.dirichlet(np.full(k, 0.3), 20 * k)
    return StealthyShield(epsilon=1.5, seed=seed, seeding=seeding).fit(
        val, np.arange(20 * k) % k
    )


def _net(seed: int = 0, last: torch.nn.Module | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [
        torch.nn.Linear(6, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 5),
    ]
    return torch.nn.Sequential(*layers, *([] if last is None else [last]))


def _uncertain_inputs(n: int = 64) -> torch.Tensor:
    """Inputs whose outputs are uncertain (small logits): SSD moves them a lot."""
    return 0.05 * torch.randn(n, 6, generator=torch.Generator().manual_seed(1))


# --- torch.compile ---------------------------------------------------------------


@pytest.mark.parametrize(
    "backend",
    ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("seeding", ["input-hash", "random"])
def test_compiled_module_answers_as_eager(backend, seeding):
    torch._dynamo.reset()
    eager = ShieldedModule(_net(), _shield(), seeding=seeding)
    twin = ShieldedModule(_net(), _shield(), seeding=seeding)
    compiled = torch.compile(twin, backend=backend)
    x = _uncertain_inputs()
    for call in range(3):  # random seeding: the stream advances alike in both
        batch = x + call
        expected = eager(batch)
        got = compiled(batch)
        assert torch.equal(got, expected), f"call {call} differs under {backend}"
    assert twin.shield.counter_ == eager.shield.counter_


def test_compiled_model_inside_the_wrapper():
    """A user who compiles the model first: answers unchanged (probs still found)."""
    torch._dynamo.reset()
    net = _net(last=torch.nn.Softmax(dim=1))
    x = _uncertain_inputs()
    expected = ShieldedModule(net, _shield())(x)
    wrapped = ShieldedModule(torch.compile(net, backend="eager"), _shield())
    assert torch.equal(wrapped(x), expected)


# --- torch.jit -----------------------------------------------------------------------


def test_jit_trace_refuses_at_trace_time_never_a_frozen_output():
    module = ShieldedModule(_net(), _shield())
    x = _uncertain_inputs(8)
    with pytest.raises(TorchToolError, match="recorded as constants"):
        torch.jit.trace(module, x)
    with pytest.raises(TorchToolError, match=r"jit\.trace"):
        torch.jit.trace(torch.nn.Sequential(module), x)  # nested: still refused


def test_jit_script_refuses_naming_why():
    module = ShieldedModule(_net(), _shield())
    with pytest.raises(TorchToolError, match="numpy"):
        torch.jit.script(module)
    with pytest.raises(TorchToolError, match="TorchScript"):
        torch.jit.script(torch.nn.Sequential(module))


def test_export_and_fx_refuse_naming_why():
    module = ShieldedModule(_net(), _shield())
    x = _uncertain_inputs(8)
    with pytest.raises(TorchToolError, match=r"torch\.export"):
        torch.export.export(module, (x,))
    with pytest.raises(TorchToolError, match=r"torch\.fx"):
        torch.fx.symbolic_trace(module)


def test_a_traced_or_scripted_model_can_be_wrapped():
    """The documented way: trace (or script) the bare model, then wrap it."""
    net = _net()
    x = _uncertain_inputs()
    expected = ShieldedModule(net, _shield(), outputs="logits")(x)
    traced = torch.jit.trace(net, x[:4])
    scripted = torch.jit.script(net)
    for tool in (traced, scripted):
        got = ShieldedModule(tool, _shield(), outputs="logits")(x)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    fresh = _uncertain_inputs(3) * 40  # not the traced example: answers follow x
    a = ShieldedModule(traced, _shield(), outputs="logits")(fresh)
    b = ShieldedModule(net, _shield(), outputs="logits")(fresh)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# --- non-finite outputs --------------------------------------------------------------


def test_nan_weights_are_refused_by_name():
    net = _net()
    module = ShieldedModule(net, _shield())
    with torch.no_grad():
        net[2].weight[1, 0] = float("nan")
    # at wrapping time the parameter is named; a later breakage shows in the outputs
    with pytest.raises(ValueError, match=r"Sequential: parameter '2.weight' holds 1"):
        ShieldedModule(net, _shield())
    with pytest.raises(ValueError, match=r"wrapped model \(Sequential\).*NaN or inf"):
        module(_uncertain_inputs(4))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="NaN or inf"):
        torch.compile(module, backend="eager")(_uncertain_inputs(4))


class _Fixed(torch.nn.Module):
    """Answers a fixed output row for every input row."""

    def __init__(self, row: list[float]) -> None:
        super().__init__()
        self.row = torch.tensor(row, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.row.expand(x.shape[0], -1).clone()


@pytest.mark.parametrize(
    ("row", "outputs"),
    [
        ([1.0, float("inf"), 0.0, 0.0, 0.0], "logits"),
        ([float("-inf")] * 5, "logits"),
        ([float("-inf")] * 5, "log-probs"),
        ([0.5, 0.5, float("inf"), 0.0, 0.0], "probs"),
        ([0.5, 0.5, float("-inf"), 0.0, 0.0], "probs"),
        ([0.5, float("nan"), 0.5, 0.0, 0.0], "auto"),
    ],
)
def test_non_finite_outputs_are_refused(row, outputs):
    module = ShieldedModule(_Fixed(row), _shield(), outputs=outputs)
    with pytest.raises(ValueError, match=r"wrapped model \(_Fixed\)"):
        module(torch.zeros(3, 2))


def test_minus_inf_logits_are_a_masked_class():
    """-inf logits (a class masked out) mean probability 0: accepted, as softmax."""
    row = [2.0, float("-inf"), 0.5, 0.1, float("-inf")]
    masked = ShieldedModule(_Fixed(row), _shield(), outputs="logits")(torch.zeros(4, 2))
    probs = torch.softmax(torch.tensor(row, dtype=torch.float64), 0)
    direct = ShieldedModule(_Fixed(probs.tolist()), _shield(), outputs="probs")(
        torch.zeros(4, 2)
    )
    torch.testing.assert_close(masked, direct, rtol=0, atol=1e-12)


def test_callable_with_nan_is_refused_by_name():
    def predict_proba(x):
        return np.full((len(x), 5), np.nan)

    with pytest.raises(ValueError, match=r"wrapped model \(.*predict_proba\)"):
        ShieldedCallable(predict_proba, _shield())(np.zeros((2, 3)))


# --- seeding: input-hash by default ------------------------------------------------


def test_default_is_input_hash_and_the_users_shield_is_untouched():
    shield = _shield(seeding="random")
    module = shield.wrap(_net())
    callable_ = shield.wrap(lambda x: _net()(x))
    x = _uncertain_inputs()
    assert module.seeding == "input-hash" == module.shield.seeding
    assert torch.equal(module(x), module(x))  # same input, same answer: 100 %
    assert torch.equal(callable_(x), callable_(x))
    assert shield.seeding == "random"
    assert shield.counter_ == 0


def test_random_seeding_is_an_explicit_choice():
    x = _uncertain_inputs()
    module = ShieldedModule(_net(), _shield(seeding="input-hash"), seeding="random")
    assert module.shield.seeding == "random"
    assert module.shield.hash_resolution is None
    first, second = module(x), module(x)
    assert not torch.equal(first, second)  # fresh pseudo-labels per answer
    with pytest.raises(ValueError, match="seeding must be one of"):
        ShieldedModule(_net(), _shield(), seeding="fresh")  # type: ignore[arg-type]


def test_voting_over_repeats_learns_nothing_under_the_default():
    """The attack random seeding invites: repeat each query and vote."""
    x = _uncertain_inputs(32)
    hashed = ShieldedModule(_net(), _shield())
    single = hashed(x).argmax(1)
    votes = torch.stack([hashed(x).argmax(1) for _ in range(15)])
    assert torch.equal(torch.mode(votes, 0).values, single)
    clean = _net()(x).argmax(1)
    flipped = single != clean
    assert flipped.any()  # the defense moved some labels, and voting cannot undo it
    noisy = ShieldedModule(_net(), _shield(), seeding="random")
    votes = torch.stack([noisy(x).argmax(1) for _ in range(15)])
    assert (votes != votes[0]).any()  # random seeding: repeats differ, votes average


def test_saved_state_brings_its_seeding():
    x = _uncertain_inputs()
    saved = ShieldedModule(_net(), _shield(), seeding="random")
    saved(x)
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    restored = ShieldedModule(_net(), StealthyShield())  # default input-hash
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.seeding == "random" == restored.shield.seeding
    assert torch.equal(restored(x), saved(x))


# --- a family of user modules ---------------------------------------------------


class _InplaceView(torch.nn.Module):
    """An in-place activation on a view of a tensor read again (CIVET's trap)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        torch.nn.functional.relu(h[:, :4], inplace=True)
        return self.head(h)


class _Tokens(torch.nn.Module):
    """Embedding + LayerNorm over integer token ids (integer inputs are hashed too)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)).mean(dim=1))


def _family():
    torch.manual_seed(0)
    batchnorm = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 5)
    ).eval()
    x = _uncertain_inputs(16)
    tokens = torch.randint(0, 20, (16, 3), generator=torch.Generator().manual_seed(2))
    return [
        ("float64", _net().double(), x.double()),
        ("in-place view", _InplaceView(), x),
        ("batchnorm (eval)", batchnorm, x),
        ("log-softmax ending", _net(last=torch.nn.LogSoftmax(dim=1)), x),
        ("token ids", _Tokens(), tokens),
    ]


@pytest.mark.parametrize("case", range(5))
def test_user_modules_get_the_shield_of_their_own_outputs(case):
    """Eager and compiled: the answer is the shield applied to the module's output."""
    name, module, x = _family()[case]
    wrapped = ShieldedModule(module, _shield())
    with torch.no_grad():
        out = module(x)
    probs = out.double().exp() if "log-softmax" in name else out.double().softmax(1)
    reference = _shield().wrap(lambda z: z, outputs="probs").shield
    expected = reference(probs, inputs=x)
    got = wrapped(x)
    assert got.dtype == out.dtype, name
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(wrapped, backend="eager")(x), got), name
