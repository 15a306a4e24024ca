"""`tripwire learn` and the `learned_invariants` rule on real training (issue 24, item 5).

For one zoo pipeline per framework (benchmarks/zoo: the Lightning ReLU MLP, the Keras MLP, the XGBoost binary
classifier), built from the zoo's own blocks with a seed of the test's: invariants learned from seeds 1 and 2 give
no warning on seed 3, trained with the learned file as its config (in process) and checked offline; and a fault
the zoo injects into the same pipeline breaks some of them. The runs are short (one epoch, 100 rounds).
"""

import textwrap

import pytest

import tripwire
from benchmarks.zoo import data
from benchmarks.zoo.case import Attach
from tripwire.core.cli import main
from tripwire.core.evaluate import check as evaluate
from tripwire.core.history import History

# What the healthy runs capture: every collection a neural network's rules read, sampled every 5 steps.
CAPTURE = {"sampling": {"every": 5},
           "collections": {"weights": {}, "biases": {}, "gradients": {}, "losses": {}, "metrics": {}, "optimizer": {},
                           "activations": {"reductions": ["mean", "std", "min", "max", "l2", "zero_fraction",
                                                          "dead_fraction"]}}}
BOOSTER_CAPTURE = {"sampling": {"every": 1}, "collections": {"losses": {}, "metrics": {}, "trees": {}}}


def learned(tmp_path, train, config=CAPTURE) -> str:
    """`tripwire learn` over the runs of seeds 1 and 2 of a pipeline; the learned file's path."""
    runs = [train(Attach(config, str(tmp_path / f"seed{seed}")), seed) for seed in (1, 2)]
    path = str(tmp_path / "learned.yaml")
    assert main(["learn", *runs, "-o", path]) == 0
    return path


def counted(verdicts) -> list:
    return [v for v in verdicts if v.counts]


def check(run_url: str, config: str, capsys) -> tuple[int, str]:
    """`tripwire check RUN --config FILE`: its exit status and what it printed."""
    code = main(["check", run_url, "--config", config])
    return code, capsys.readouterr().out


def assert_silent_on_another_seed(train, learned_file, tmp_path, capsys):
    """Seed 3, trained with the learned file as its config: no warning, in process or offline."""
    attach = Attach(learned_file, str(tmp_path / "seed3"))
    run_url = train(attach, 3)
    assert counted(attach.callback.verdicts) == []
    code, out = check(run_url, learned_file, capsys)
    assert code == 0 and "0 finding(s) at warning or error" in out, out
    assert "could not check anything" not in out, out  # judged, not left without data


def assert_caught(run_url: str, learned_file: str, capsys, kind: str, reduction: str) -> None:
    """Offline, the fault's run breaks learned invariants: warnings (never errors), one of them about `kind` (in
    words), its `reduction` among those broken."""
    verdicts = counted(evaluate(tripwire.open_run(run_url), learned_file))
    assert verdicts and {v.rule for v in verdicts} == {"learned_invariants"}, verdicts
    assert {v.severity for v in verdicts} == {"warning"}
    (found,) = [v for v in verdicts if v.finding == kind] or [verdicts]
    assert reduction in [b["reduction"] for b in found.evidence["broken"]], found
    assert found.message.split(": ")[0].endswith(kind if " " not in kind else f"({kind})"), found.message
    assert found.evidence["learned_from"] and found.evidence["seen"][0] <= found.evidence["seen"][1]
    code, out = check(run_url, learned_file, capsys)
    assert code == 1 and "a departure from what healthy runs of this pipeline held" in out, out


# -- Lightning: the zoo's ReLU MLP (torch_cases.mlp_relu) and its dead_relu_bias twin --------------------------------
def lightning_mlp(attach, seed, build=None) -> str:
    """mlp_relu's model, optimizer and data for one epoch, its initial weights and data order drawn from `seed`."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.zoo import torch_cases as zoo

    torch.manual_seed(seed)
    (xt, yt), (xv, yv) = data.digits()
    model = zoo.Classifier((build or zoo.mlp)(), zoo.adam(), return_preds=True)
    train = DataLoader(TensorDataset(torch.as_tensor(xt), torch.as_tensor(yt)), batch_size=32, shuffle=True,
                       generator=torch.Generator().manual_seed(seed))
    zoo.fit(attach, model, train, zoo.loader(xv, yv, batch_size=256, shuffle=False), 1)
    return attach.run_url


@pytest.fixture(scope="module")
def lightning_learned(tmp_path_factory):
    return learned(tmp_path_factory.mktemp("lightning"), lightning_mlp)


def test_lightning_mlp_another_seed_breaks_no_learned_invariant(lightning_learned, tmp_path, capsys):
    assert_silent_on_another_seed(lightning_mlp, lightning_learned, tmp_path, capsys)


def test_lightning_mlp_with_dead_relu_biases_breaks_learned_invariants(lightning_learned, tmp_path, capsys):
    from benchmarks.zoo.torch_cases import first_layer_biases, mlp

    run_url = lightning_mlp(Attach(CAPTURE, str(tmp_path / "dead")), 0, lambda: first_layer_biases(mlp(), -20.0))
    assert_caught(run_url, lightning_learned, capsys, "activations after Linear layers", "dead_fraction")


# -- Keras: the zoo's digits MLP (keras_cases.digits_mlp) and its mlp_lr_x1000 twin --------------------------------
def keras_mlp(attach, seed, lr_factor=1) -> str:
    """digits_mlp's model and optimizer for one epoch, from a session seeded with `seed`."""
    from benchmarks.zoo import keras_cases as zoo

    zoo.start(seed)
    zoo.fit_digits(zoo.mlp(), attach, False, lr=zoo.MLP_LR * lr_factor, epochs=1)
    return attach.run_url


@pytest.fixture(scope="module")
def keras_learned(tmp_path_factory):
    return learned(tmp_path_factory.mktemp("keras"), keras_mlp)


def test_keras_mlp_another_seed_breaks_no_learned_invariant(keras_learned, tmp_path, capsys):
    assert_silent_on_another_seed(keras_mlp, keras_learned, tmp_path, capsys)


def test_keras_mlp_with_a_learning_rate_1000x_breaks_learned_invariants(keras_learned, tmp_path, capsys):
    run_url = keras_mlp(Attach(CAPTURE, str(tmp_path / "lr")), 0, lr_factor=1000)
    assert_caught(run_url, keras_learned, capsys, "optimizer/lr", "value")


# -- XGBoost: the zoo's binary classifier (xgboost_cases.binary) and its overfitting_booster twin ------------------
def booster(attach, seed) -> str:
    """binary's booster on breast cancer, its row and column subsampling drawn from `seed`."""
    from benchmarks.zoo import xgboost_cases as zoo

    train, val = data.breast_cancer(standardise=False)
    zoo.boost_binary(attach, False, train, val, seed=seed)
    return attach.run_url


@pytest.fixture(scope="module")
def booster_learned(tmp_path_factory):
    return learned(tmp_path_factory.mktemp("xgboost"), booster, BOOSTER_CAPTURE)


def test_booster_another_seed_breaks_no_learned_invariant(booster_learned, tmp_path, capsys):
    assert_silent_on_another_seed(booster, booster_learned, tmp_path, capsys)


def test_overfitting_booster_breaks_learned_invariants(booster_learned, tmp_path, capsys):
    from benchmarks.zoo.xgboost_cases import overfitting_booster

    attach = Attach(BOOSTER_CAPTURE, str(tmp_path / "overfit"))
    overfitting_booster(attach, False)
    assert_caught(attach.run_url, booster_learned, capsys, "metrics/train/logloss", "value")


def test_learn_reads_runs_at_any_fsspec_url(booster_learned, tmp_path):
    """The same boosters, stored in memory://, learn the same invariants; their URLs are quoted in the file."""
    runs = [booster(Attach(BOOSTER_CAPTURE, f"memory://learn-{tmp_path.name}/seed{seed}"), seed) for seed in (1, 2)]
    path = tmp_path / "learned.yaml"
    assert main(["learn", *runs, "-o", str(path)]) == 0
    invariants = lambda text: [line for line in text.splitlines() if line.startswith("        - {")]  # noqa: E731
    assert invariants(path.read_text()) == invariants(open(booster_learned).read())
    assert tripwire.load_config(str(path)).rules[0].params["learned_from"] == runs


# -- kinds, the file, and what the verb says ------------------------------------------------------------------------
def test_a_renamed_and_deeper_model_has_the_same_kinds_of_tensors():
    """Invariants name tensors by collection, layer class and role: the kinds of a model with other names and more
    layers are those of the one learned from."""
    from collections import OrderedDict

    from torch import nn

    from tripwire.core.rules.learned import kind_of
    from tripwire.plugins.torch.structure import describe

    learned_from = describe(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    deeper = describe(nn.Sequential(OrderedDict([("inp", nn.Linear(8, 32)), ("act", nn.ReLU()),
                                                 ("mid", nn.Linear(32, 16)), ("act2", nn.ReLU()),
                                                 ("out", nn.Linear(16, 2))])))
    def run_of(model):
        run = History()
        run.model = model
        return run

    learned_from, deeper = run_of(learned_from), run_of(deeper)
    kinds = lambda run, names: {tuple(sorted(kind_of(run, n).items())) for n in names}  # noqa: E731
    assert kinds(learned_from, ["gradients/0.weight", "biases/2.bias", "activations/1"]) == \
        kinds(deeper, ["gradients/inp.weight", "gradients/mid.weight", "biases/out.bias", "activations/act2"])
    assert kind_of(deeper, "activations/act2") == {"collection": "activations", "layer_class": "Linear",
                                                   "role": "activation"}
    assert kind_of(deeper, "losses/train") == {"tensor": "losses/train"}


def test_a_learned_file_with_mistakes_names_each_at_its_line(tmp_path):
    path = tmp_path / "learned.yaml"
    path.write_text(textwrap.dedent("""\
        rules:
          - rule: learned_invariants
            params:
              learned_from: [runs/a]
              invariants:
                - {tensor: losses/train, mode: train, steps: [10, 99], reduction: value, seen: [0.1, 2.0], low: 0.01}
                - {tensor: losses/train, mode: train, steps: [10, 99], reduction: vaule, seen: [0.1, 2.0], low: 0.01}
                - {collection: gradients, layer_class: Linear, role: kernal, steps: [0, 0], reduction: l2, seen: [1, 2]}
                - {tensor: losses/train, steps: [99, 10], reduction: value, seen: [0.1, 2.0], high: 1.0, colour: red}
        """))
    with pytest.raises(tripwire.ConfigError) as err:
        tripwire.load_config(str(path))
    where = [(p.line, p.key) for p in err.value.problems]
    assert where == [(7, "rules[0].params.invariants[1].reduction"), (8, "rules[0].params.invariants[2].role"),
                     (8, "rules[0].params.invariants[2]"), (9, "rules[0].params.invariants[3].colour"),
                     (9, "rules[0].params.invariants[3].steps"), (9, "rules[0].params.invariants[3].seen")], where
    said = str(err.value)
    assert "'kernal' is not a role of gradients" in said and "needs `low`, `high` or both" in said
    assert "must lie within the bounds" in said  # seen up to 2.0, high 1.0: the healthy runs broke it
    with pytest.raises(tripwire.ConfigError, match=r"rules\[0\]\.params\.invariants: expected a list of invariants, "
                                                   "got none: write them with `tripwire learn"):
        tripwire.load_config({"rules": [{"rule": "learned_invariants", "params": {"invariants": []}}]})


def test_learn_says_what_it_could_not_do(tmp_path, capsys):
    """A run too short to learn from, and a run that is not there: exit 2, one line that says what to do."""
    import torch

    from tripwire.plugins.torch import TripwireProbe

    net = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with TripwireProbe(net, optimizer, {"collections": {"losses": {}}}, out_dir=tmp_path / "short") as probe:
        for _ in range(3):
            optimizer.zero_grad()
            loss = net(torch.ones(8, 4)).pow(2).mean()
            loss.backward()
            optimizer.step()
            probe.step(loss)
    assert main(["learn", str(tmp_path / "short"), "-o", str(tmp_path / "l.yaml")]) == 2
    assert "nothing learned" in capsys.readouterr().err and not (tmp_path / "l.yaml").exists()
    assert main(["learn", str(tmp_path / "nowhere"), "-o", str(tmp_path / "l.yaml")]) == 2
    assert "no tripwire run at" in capsys.readouterr().err
