"""The plain-PyTorch-loop probe on real training loops: capture, NaN stop (flag and exception), checkpoint, eval."""

import numpy as np
import pytest
import torch

import helpers
import tripwire
from tripwire.plugins.torch import TripwireProbe


def model_and_data(lr=0.1, seed=0):
    torch.manual_seed(seed)
    (x, y), _ = helpers.digits()
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    batches = [(torch.tensor(x[i:i + 32]), torch.tensor(y[i:i + 32], dtype=torch.long))
               for i in range(0, len(x) - 31, 32)]
    return net, optimizer, batches


def train(probe, net, optimizer, batches, steps, nan_from=None):
    """A plain loop; stops when the probe says so. Returns the number of optimizer steps taken."""
    done = 0
    for step in range(steps):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        if nan_from is not None and step >= nan_from:
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
        probe.step(loss, labels=y)
        done += 1
        if probe.should_stop:
            break
    return done


CAPTURE = {"sampling": {"every": 5}, "rules": [],
           "collections": {"weights": {}, "biases": {}, "gradients": {"reductions": ["l2", "mean"]},
                           "activations": {}, "inputs": {}, "labels": {}, "losses": {},
                           "updates": {"reductions": ["l2"]}, "optimizer": {}}}


def test_captures_a_plain_loop_at_the_sampled_steps(tmp_path):
    net, optimizer, batches = model_and_data()
    initial = net[0].weight.detach().clone()
    first_grad = {}
    net[0].weight.register_hook(lambda g: first_grad.setdefault("g", g.detach().clone()))
    with TripwireProbe(net, optimizer, CAPTURE, out_dir=tmp_path / "run") as probe:
        assert train(probe, net, optimizer, batches, 23) == 23
    run = tripwire.open_run(probe.run_url)
    assert run.info["status"] == "finished" and run.info["framework"] == "torch"
    assert run.steps() == [0, 5, 10, 15, 20]
    assert {"weights/0.weight", "biases/0.bias", "gradients/0.weight", "activations/0", "activations/1",
            "inputs/x", "labels", "losses/train", "updates/0.weight", "optimizer/lr"} <= set(run.tensor_names())
    # weights as they were before the step's update, gradients of that step
    assert run.tensor("weights/0.weight").reduction(0, "l2") == pytest.approx(float(initial.norm()), rel=1e-5)
    assert run.tensor("gradients/0.weight").reduction(0, "l2") == pytest.approx(float(first_grad["g"].norm()),
                                                                                rel=1e-5)
    update = run.tensor("updates/0.weight").reduction(0, "l2")
    assert update == pytest.approx(0.1 * float(first_grad["g"].norm()), rel=1e-4)  # SGD: lr x gradient
    assert run.tensor("optimizer/lr").series()[1].tolist() == [0.1] * 5


def test_a_compiled_model_is_named_as_the_model_it_compiles(tmp_path):
    """torch.compile wraps the model in a module that holds it as `_orig_mod`, and activation checkpointing wraps a
    layer as `_checkpoint_wrapped_module`: neither is a layer of the user's, so the tensors carry the same names as
    the plain model's and the runs of one model compare."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    names = {}
    for wrapped in (False, True):
        net, optimizer, batches = model_and_data()
        model = torch.compile(torch.nn.Sequential(net[0], net[1], checkpoint_wrapper(net[2])), backend="eager") \
            if wrapped else net
        with TripwireProbe(model, optimizer, CAPTURE, out_dir=tmp_path / f"run-{wrapped}") as probe:
            train(probe, model, optimizer, batches, 23)
        run = tripwire.open_run(probe.run_url)
        names[wrapped] = run.tensor_names()
        assert run.model.name == "Sequential" and list(run.model.parameters) == ["0.weight", "0.bias", "2.weight",
                                                                                  "2.bias"]
        assert run.tensor("losses/train").reduction(20) < 0.8 * run.tensor("losses/train").reduction(0)
    assert names[True] == names[False] and "gradients/2.weight" in names[True] and "activations/1" in names[True]


def test_hooks_run_only_on_sampled_steps_and_are_removed_at_close(tmp_path):
    net, optimizer, batches = model_and_data()
    probe = TripwireProbe(net, optimizer, CAPTURE, out_dir=tmp_path / "run")
    train(probe, net, optimizer, batches, 3)
    # activation hooks live for a sampled step only; the model's own hook keeps the last forward (a NaN's origin)
    assert all(not m._forward_hooks for m in list(net.modules())[1:]) and len(net._forward_hooks) == 1
    assert net._forward_pre_hooks
    probe.close()
    assert not net._forward_pre_hooks and not net._forward_hooks and not optimizer._optimizer_step_pre_hooks


def test_eval_forward_passes_do_not_begin_a_step(tmp_path):
    net, optimizer, batches = model_and_data()
    config = {**CAPTURE, "collections": {**CAPTURE["collections"], "metrics": {}}}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        for step in range(7):
            x, y = batches[step]
            net.eval()
            with torch.no_grad():
                net(x)
            net.train()
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            probe.step(loss)
            probe.log_eval({"val_loss": loss.item()})
    run = tripwire.open_run(probe.run_url)
    assert run.steps() == [0, 5] and probe.global_step == 7
    assert run.steps(mode="eval") == list(range(1, 8))  # eval metrics at the global step after each train step
    assert run.tensor("metrics/val_loss").series(mode="eval")[0].tolist() == list(range(1, 8))


def test_nan_sets_should_stop_at_the_step_it_appears(tmp_path):
    net, optimizer, batches = model_and_data()
    config = {"sampling": {"every": 4}, "rules": [{"rule": "exploding_tensor", "actions": ["log", "checkpoint",
                                                                                         "stop"]}]}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        done = train(probe, net, optimizer, batches, 100, nan_from=10)
    # NaN from step 10, sampled every 4: the loss is judged at every step, so it stops after step 10
    assert done == 11 and probe.should_stop
    run = tripwire.open_run(probe.run_url)
    (verdict,) = [v for v in run.verdicts() if v.fired]
    assert verdict.rule == "exploding_tensor" and verdict.step == 10
    assert probe.verdicts[0].step == 10 and run.info["status"] == "stopped"
    (checkpoint,) = (tmp_path / "run" / "checkpoints").iterdir()
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == 10 and set(state["model"]) == set(net.state_dict())


def test_raise_action_ends_training_with_rule_fired(tmp_path):
    net, optimizer, batches = model_and_data(lr=50.0)
    config = {"sampling": {"every": 1}, "rules": [{"rule": "exploding_tensor", "actions": ["raise"]}]}
    with pytest.raises(tripwire.RuleFired) as raised:
        with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
            train(probe, net, optimizer, batches, 200)
    run = tripwire.open_run(probe.run_url)
    verdict = raised.value.verdict
    assert verdict.rule == "exploding_tensor" and verdict.step == run.steps()[-1] == probe.global_step - 1
    assert not np.isfinite(run.tensor("losses/train").series()[1][-1])
    assert run.info["status"] == "stopped"


def test_a_loop_that_updates_by_hand_fires_nothing(tmp_path):
    """No optimizer: the loop applies its gradients itself, as PyTorch's word-language-model and regression examples
    do. Its parameters train all the same: none is 'held by no optimizer'."""
    net, _, batches = model_and_data()
    with TripwireProbe(net, [], out_dir=tmp_path / "run") as probe:
        for step in range(120):
            x, y = batches[step % len(batches)]
            net.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            for p in net.parameters():
                p.data.add_(p.grad, alpha=-0.1)
            probe.step(loss)
    run = tripwire.open_run(probe.run_url)
    assert float(loss) < 0.5  # it learns
    assert not [v for v in run.verdicts() if v.fired and v.severity != "info"]
    assert all(p.trainable for p in run.model.parameters.values())


def polynomial_fit(probe_dir):
    """PyTorch's regression example: a Linear(4, 1) fitted to a polynomial whose coefficients are ~N(0, 25)."""
    torch.manual_seed(0)
    coefficients, bias, fc = torch.randn(4, 1) * 5, torch.randn(1) * 5, torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(fc.parameters(), lr=0.1)
    with TripwireProbe(fc, optimizer, out_dir=probe_dir) as probe:
        for _ in range(300):
            x = torch.randn(32, 1)
            features = torch.cat([x ** i for i in range(1, 5)], 1)
            optimizer.zero_grad()
            loss = torch.nn.functional.smooth_l1_loss(fc(features), features @ coefficients + bias)
            loss.backward()
            optimizer.step()
            probe.step(loss)
    return probe, float(loss) < 0.1


def lbfgs_fit(probe_dir):
    """PyTorch's time-sequence example's optimizer: LBFGS at lr 0.8, a closure per step, to convergence; the
    accuracy after each step, measured in train mode, so that the next step begins before its optimizer's."""
    net, _, batches = model_and_data()
    x, y = torch.cat([b[0] for b in batches[:16]]), torch.cat([b[1] for b in batches[:16]])
    optimizer = torch.optim.LBFGS(net.parameters(), lr=0.8)
    with TripwireProbe(net, optimizer, out_dir=probe_dir) as probe:
        for _ in range(8):
            def closure():
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(x), y)
                loss.backward()
                return loss
            loss = optimizer.step(closure)
            probe.step(loss)
            with torch.no_grad():  # the accuracy after the step, in train mode: this forward begins the next step
                probe.log_eval({"accuracy": float((net(x).argmax(1) == y).float().mean())})
    return probe, float(loss) < 0.1


def unscaled_targets_fit(probe_dir):
    """A regression MLP on sklearn's diabetes, targets as they come (25 to 346), MSE and Adam: the loss starts near
    3e4 and the gradients are in the thousands while it trains."""
    from sklearn.datasets import load_diabetes

    torch.manual_seed(0)
    x, y = (torch.tensor(a, dtype=torch.float32) for a in load_diabetes(return_X_y=True))
    net = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    with TripwireProbe(net, optimizer, out_dir=probe_dir) as probe:
        for step in range(300):
            i = 32 * (step % 13)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x[i:i + 32]).squeeze(1), y[i:i + 32])
            loss.backward()
            optimizer.step()
            probe.step(loss)
    mse = float(torch.nn.functional.mse_loss(net(x).squeeze(1), y))
    return probe, mse / float(y.var()) < 0.7  # learned: explains 30 % of the variance (the best models ~50 %)


def zero_samples_fit(probe_dir):
    """StackOverflow 31880720's fixed program: samples of 128 ones (label 1) or 128 zeros (label 0), one per step,
    an MLP ending in a sigmoid under binary cross-entropy, RMSprop (no momentum). A sample of zeros gives the first
    kernel no gradient, and the step no update: here steps 0 and 1, and every hundredth."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 50), torch.nn.ReLU(), torch.nn.Linear(50, 50), torch.nn.ReLU(),
                              torch.nn.Linear(50, 1), torch.nn.Sigmoid())
    optimizer = torch.optim.RMSprop(net.parameters(), lr=1e-3)
    with TripwireProbe(net, optimizer, out_dir=probe_dir) as probe:
        for step in range(400):
            label = float(step % 4 in (2, 3))
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy(net(torch.full((1, 128), label)), torch.tensor([[label]]))
            loss.backward()
            optimizer.step()
            probe.step(loss)
    with torch.no_grad():
        scores = net(torch.stack([torch.zeros(128), torch.ones(128)]))
    return probe, scores[0] < 0.1 and scores[1] > 0.9


@pytest.mark.parametrize("fit", [polynomial_fit, lbfgs_fit, unscaled_targets_fit, zero_samples_fit],
                         ids=["polynomial_regression", "lbfgs", "unscaled_regression", "zero_samples"])
def test_healthy_example_programs_fire_nothing(tmp_path, fit):
    """The regressor's output kernel grows to the targets' scale (variance ~25); an LBFGS step moves the weights by
    more than their norm, and a converged one not at all; targets in the hundreds make gradients in the thousands;
    a batch of one sample of zeros leaves the first kernel as it was: none of it is a fault. Each fit returns (its
    probe, whether it learned)."""
    probe, learned = fit(tmp_path / "run")
    assert learned
    run = tripwire.open_run(probe.run_url)
    assert not [(v.rule, v.message) for v in run.verdicts() if v.fired and v.severity != "info"]


def test_default_config_on_a_healthy_loop_fires_nothing(tmp_path):
    net, optimizer, batches = model_and_data()
    with TripwireProbe(net, optimizer, out_dir=tmp_path / "run") as probe:
        train(probe, net, optimizer, batches, 120)
    run = tripwire.open_run(probe.run_url)
    assert not [v for v in run.verdicts() if v.fired] and run.info["status"] == "finished"
    assert run.tensor("gradients/0.weight").steps()[-1] == 100
    # every step's loss is stored (the unsampled ones read at the next sample), as no sample of their own
    assert run.steps() == [*range(10), 100] and run.tensor("losses/train").steps() == list(range(120))


def test_the_model_record_says_how_long_batchnorm_statistics_keep_their_start():
    """An evaluation normalises with BatchNorm's running statistics: torch's momentum 0.1 leaves under 1 % of their
    initial values after 44 training steps; a cumulative average (momentum None) and LayerNorm keep none;
    momentum 0 keeps them for ever."""
    from tripwire.core.model import ModelInfo
    from tripwire.plugins.torch.structure import describe

    model = describe(torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                         torch.nn.Linear(4, 8),
                                         torch.nn.BatchNorm1d(8, momentum=None), torch.nn.LayerNorm(8)))
    assert model.running_keep == pytest.approx(0.9)
    assert not model.statistics_settled(43) and model.statistics_settled(44)
    assert ModelInfo.from_dict(model.to_dict()).running_keep == pytest.approx(0.9)
    plain = describe(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, momentum=None)))
    assert plain.running_keep is None and plain.statistics_settled(0)
    kept = describe(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, momentum=0.0)))
    assert kept.running_keep == 1.0 and not kept.statistics_settled(10 ** 6)  # momentum 0: never the data's
    assert ModelInfo.from_dict(kept.to_dict()).running_keep == 1.0  # read the same in a side process


class SharedRelu(torch.nn.Module):
    """One in-place ReLU module called three times per forward pass, as torchvision's BasicBlock calls its relu:
    after a layer, after dropout over a layer, and on a residual sum made in place (`out += identity`)."""

    def __init__(self, first_bias=None):
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.out = (torch.nn.Linear(64, 32), torch.nn.Linear(32, 32),
                                                  torch.nn.Linear(32, 32), torch.nn.Linear(32, 10))
        self.drop, self.relu = torch.nn.Dropout(0.1), torch.nn.ReLU(inplace=True)  # registered after every layer
        if first_bias is not None:
            torch.nn.init.constant_(self.fc1.bias, first_bias)

    def forward(self, x):
        h = self.relu(self.fc1(x))
        h = self.relu(self.drop(self.fc2(h)))
        out = self.fc3(h)
        out += h
        return self.out(self.relu(out))


@pytest.mark.parametrize("first_bias", [None, -20.0], ids=["healthy", "first_call_dead"])
def test_each_call_of_a_shared_activation_is_captured_with_the_layer_it_takes(tmp_path, first_bias):
    """A module called several times in a forward pass is captured at each call (`relu`, `relu#2`, `relu#3`), each
    with the layer whose output it took as the first sampled step saw it (through dropout; none for a sum, also
    one made in place on the layer's output). The last call alone was captured before, under the layer registered
    last: a dead first call went unseen."""
    _, optimizer, batches = model_and_data()
    torch.manual_seed(0)
    net = SharedRelu(first_bias)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    config = {"sampling": {"every": 5}, "collections": {"activations": {}}, "rules": [{"rule": "dead_relu"}]}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        train(probe, net, optimizer, batches, 150)
    run = tripwire.open_run(probe.run_url)
    assert {"activations/relu", "activations/relu#2", "activations/relu#3"} <= set(run.tensor_names())
    assert run.first_step.producers == {"relu": "fc1", "relu#2": "fc2"}
    assert run.input_layer("relu#3") is None
    fired = [v for v in run.verdicts() if v.fired]
    if first_bias is None:
        assert not fired
        net.eval()
        accuracy = np.mean([(net(x).argmax(1) == y).float().mean().item() for x, y in batches])
        assert accuracy > 0.9  # it learned
    else:
        assert [(v.rule, v.severity, v.finding) for v in fired][:1] == [("dead_relu", "error", "activations/relu")]
        assert "(the output of Linear fc1)" in fired[0].message and "Every bias of Linear fc1" in fired[0].hint


def test_a_backbone_run_under_inference_mode_trains_on_while_the_layers_behind_activations_are_noted(tmp_path):
    """Features from a frozen backbone computed under torch.inference_mode keep no version counter, which noting
    the layer behind each activation reads: reading it raised into the training's forward pass."""
    class Probed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
            self.head = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

        def forward(self, x):
            with torch.inference_mode():
                features = self.backbone(x)
            return self.head(features.clone())

    torch.manual_seed(0)
    model = Probed()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    _, _, batches = model_and_data()
    config = {"sampling": {"every": 5}, "collections": {"activations": {}}, "rules": []}
    with TripwireProbe(model, optimizer, config, out_dir=tmp_path / "run") as probe:
        for x, y in batches[:10]:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            probe.step(loss)
    run = tripwire.open_run(probe.run_url)
    assert run.info["status"] == "finished" and run.first_step.producers == {"head.1": "head.0"}


def test_a_shared_activation_is_given_no_layer_where_no_step_was_seen():
    """Without what the first step saw (a run from before, a plugin that cannot see it), the model's structure
    names the layer before an activation for a module called once per forward pass only."""
    from tripwire.core.history import History
    from tripwire.plugins.torch.structure import describe

    run = History()
    run.model = describe(SharedRelu())
    run.add(0, "train", 0, {"activations/relu": {"dead_fraction": 0.0}})
    assert run.input_layer("relu") == "out"  # registration order: the only guess there is, for one call
    run.add(0, "train", 0, {"activations/relu#2": {"dead_fraction": 0.0}})
    assert run.input_layer("relu") is None and run.input_layer("relu#2") is None


class Experts(torch.nn.Module):
    """A Mixture of Experts with top-1 routing, each expert called on the tokens routed to it, an empty batch where
    none is (as the Switch Transformer's common implementations do). The last expert's router bias keeps every
    token away from it: it never trains."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.router = torch.nn.Linear(64, 32), torch.nn.Linear(32, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 10)
        with torch.no_grad():
            self.router.bias[-1] = -30.0

    def forward(self, x):
        h = torch.relu(self.embed(x))
        gate, route = torch.softmax(self.router(h), dim=-1).max(dim=-1)
        mixed = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            chosen = (route == i).nonzero(as_tuple=True)[0]
            mixed[chosen] = expert(h[chosen])
        return self.head(h + gate[:, None] * torch.relu(mixed))


def test_an_expert_fed_no_token_at_a_step_has_no_gradient_or_update_to_judge(tmp_path):
    """A Switch-style Mixture of Experts (8 experts, batch 16) was told, under the default config, 'gradients 100%
    zeros' (all_zero) for the experts no token was routed to at the sampled step, and 'update = 0, too small'
    (weight_update_ratio) at step 1: conditional computation, by design, on a model that learns (0.97). A layer
    run on empty batches alone at a step has no gradient or update to judge there; its weights are still captured,
    so an expert that never trains is still told (unchanged_tensor)."""
    _, _, batches = model_and_data()
    model = Experts()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    config = {"sampling": {"every": 20}, "rules": ["all_zero", "weight_update_ratio", "unchanged_tensor"]}
    with TripwireProbe(model, optimizer, config, out_dir=tmp_path / "run") as probe:
        train(probe, model, optimizer, batches, 200)
    run = tripwire.open_run(probe.run_url)
    x, y = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    assert float((model(x).argmax(1) == y).float().mean()) > 0.9
    told = {v.rule: v for v in run.verdicts() if v.counts}
    assert sorted(told) == ["unchanged_tensor"] and told["unchanged_tensor"].evidence["unchanged"] == \
        ["weights/experts.3.weight"]
    assert "gradients/experts.3.weight" not in run.tensor_names() and "gradients/experts.0.weight" in \
        run.tensor_names()


class SAM(torch.optim.Optimizer):
    """Sharpness-Aware Minimization as its common implementation (davda54/sam) writes it: first_step climbs to the
    sharpest nearby point, second_step comes back and steps the base optimizer, which shares its param_groups; its
    own step() is never called."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        norm = torch.norm(torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]
                                       if p.grad is not None]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * group["rho"] / (norm + 1e-12))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()


def test_an_optimizer_that_hands_its_steps_to_another_is_watched_through_it(tmp_path):
    """SAM's loop calls first_step and second_step, never step(): the probe, watching SAM's own steps, saw none, said
    'no optimizer stepped (gradient accumulation, or a GradScaler…)' at every sample and judged no weight, gradient
    or update (ten rules without data). It watches the base optimizer SAM steps, which shares its param_groups."""
    (x, y), _ = helpers.digits()
    x, y = torch.tensor(x), torch.tensor(y, dtype=torch.long)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    with TripwireProbe(model, optimizer, None, out_dir=tmp_path / "run") as probe:  # the default config
        for step in range(300):
            i = 32 * (step % 40)
            loss = torch.nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            loss.backward()
            optimizer.first_step()
            torch.nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
            optimizer.second_step()
            probe.step(loss)
    run = tripwire.open_run(probe.run_url)
    assert float((model(x).argmax(1) == y).float().mean()) > 0.9
    assert {"gradients/0.weight", "updates/0.weight", "relations/step_changed_nothing"} <= set(run.tensor_names())
    assert [v.rule for v in run.verdicts() if v.counts] == []
    assert not [v for v in run.verdicts() if v.status == "no_data" and v.rule in ("vanishing_gradient",
                                                                                    "weight_update_ratio")]
