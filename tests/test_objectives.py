"""What the first step says about the loss's scale and about how many objectives the step trains: a loss that sums
its terms (a VAE's pixels) has gradients that many times larger; a GAN trains two objectives against each other,
and neither loss need go down. Real loops, the probe and Lightning."""

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from torch import nn

import helpers
import tripwire
from benchmarks.zoo import torch_cases
from benchmarks.zoo.case import Attach
from tripwire.core.rules.base import FORWARDS
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe
from tripwire.core.firststep import FirstStep, not_a_fit
from tripwire.plugins.torch.firststep import LossSpy
from tripwire.plugins.torch.objectives import ForwardCounts, Objectives

F = nn.functional
ALL_LOSS_RULES = {"rules": ["loss_not_decreasing", "loss_spike", "exploding_gradient"], "sampling": {"every": 10}}
# the probe counts the forward passes per step where the config captures relations (the default config does)
COUNTING = {**ALL_LOSS_RULES, "collections": {"relations": {}}}


def first_step(url):
    return tripwire.open_run(url).first_step


def test_a_gan_loop_trains_two_objectives_and_neither_loss_is_judged_for_its_course(tmp_path):
    """The zoo's DCGAN (pytorch/examples' loop): without the count, loss_not_decreasing called its discriminator's
    loss an error at step 370 of this run; the count is 2, and the GAN still learns."""
    attach = Attach(ALL_LOSS_RULES, str(tmp_path))
    outcome = torch_cases.dcgan(attach, long=False)
    assert outcome.learned, outcome.score
    probe = attach.callback
    assert first_step(probe.run_url).objectives == 2
    assert [v for v in probe.verdicts if v.fired] == []
    not_applicable = {v.rule: v.message for v in probe.verdicts if v.status == "no_data"}
    assert set(not_applicable) == {"loss_not_decreasing", "loss_spike"}
    assert all("2 objectives" in message for message in not_applicable.values())


def embeddings_and_dense(tmp_path, scaler=None):
    """A bag of token embeddings under SparseAdam and a classifier under Adam: two optimizers, one loss, one
    backward pass (under a GradScaler where given, which unscales each optimizer's gradients just before its
    step)."""
    torch.manual_seed(0)
    embedding = nn.EmbeddingBag(50, 16, sparse=True)
    model = nn.ModuleDict({"embedding": embedding, "head": nn.Linear(16, 3)})
    sparse, dense = torch.optim.SparseAdam(embedding.parameters(), lr=1e-2), torch.optim.Adam(
        model["head"].parameters(), lr=1e-2)
    tokens, labels = torch.randint(0, 50, (20, 32, 6)), torch.randint(0, 3, (20, 32))
    with TripwireProbe(model, [sparse, dense], COUNTING, out_dir=tmp_path / "run") as probe:
        for x, y in zip(tokens, labels):
            sparse.zero_grad()
            dense.zero_grad()
            loss = F.cross_entropy(model["head"](model["embedding"](x)), y)
            if scaler is None:
                loss.backward()
                sparse.step()
                dense.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(sparse)
                scaler.step(dense)
                scaler.update()
            probe.step(loss)
    return probe


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
def test_two_optimizers_over_one_loss_train_one_objective(tmp_path, scaled):
    probe = embeddings_and_dense(tmp_path, torch.amp.GradScaler("cpu") if scaled else None)
    assert first_step(probe.run_url).objectives == 1
    assert FORWARDS not in tripwire.open_run(probe.run_url).tensor_names()  # one forward pass a step


class ManualGAN(torch_cases.GAN):
    """The zoo's Lightning GAN (manual optimisation, a discriminator step then a generator step), returning its
    discriminator's loss as the step's loss."""

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return self.trainer.callback_metrics["d_loss"]


def test_lightning_counts_the_objectives_of_a_manual_optimisation_step(tmp_path):
    callback = TripwireCallback(ALL_LOSS_RULES, out_dir=tmp_path / "gan")
    trainer = L.Trainer(max_epochs=1, callbacks=[callback], **torch_cases.TRAINER)
    trainer.fit(ManualGAN(), torch_cases.loader(torch_cases.gaussian_mixture(), batch_size=64))
    assert first_step(callback.run_url).objectives == 2
    automatic = TripwireCallback(ALL_LOSS_RULES, out_dir=tmp_path / "classifier")
    helpers.fit(automatic, helpers.mlp_module(), max_epochs=1)
    assert first_step(automatic.run_url).objectives == 1


@pytest.mark.parametrize("loss_of,terms", [
    (lambda out, y: F.binary_cross_entropy(torch.sigmoid(out), F.one_hot(y, 10).float(), reduction="sum"), 320),
    (lambda out, y: nn.CrossEntropyLoss(reduction="sum")(out, y), 32),
    (lambda out, y: F.cross_entropy(out, F.one_hot(y, 10).float(), reduction="sum"), 32),
    (lambda out, y: F.cross_entropy(out, y), None),
], ids=["bce_over_elements", "cross_entropy_over_ids", "cross_entropy_over_probabilities", "mean"])
def test_the_first_step_counts_the_terms_a_summed_loss_adds_up(tmp_path, loss_of, terms):
    torch.manual_seed(0)
    (x, y), _ = helpers.digits()
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with TripwireProbe(model, optimizer, {"rules": ["loss_setup"]}, out_dir=tmp_path / "run") as probe:
        xb, yb = torch.tensor(x[:32]), torch.tensor(y[:32], dtype=torch.long)
        optimizer.zero_grad()
        loss = loss_of(model(xb), yb)
        loss.backward()
        optimizer.step()
        probe.step(loss)
    (use,) = first_step(probe.run_url).losses
    assert use.terms == terms


def test_a_vae_whose_loss_sums_its_pixels_has_no_exploding_gradient(tmp_path):
    """pytorch/examples' VAE: its summed loss starts near 5,700 with gradient norms up to 1,650, above max_norm
    1000, which exploding_gradient called exploding at step 0; judged against the 8,192 terms the loss sums, it
    is silent."""
    attach = Attach(ALL_LOSS_RULES, str(tmp_path))
    outcome = torch_cases.vae(attach, long=False)
    assert outcome.learned, outcome.score
    probe = attach.callback
    assert first_step(probe.run_url).losses[0].terms == 128 * 64
    assert [v.rule for v in probe.verdicts if v.fired and v.severity != "info"] == []
    gradients = tripwire.open_run(probe.run_url).tensor("gradients/fc4.weight").series("l2")[1]
    assert gradients[0] > 1000  # what a mean-reduced loss's max_norm would have called exploding


class ActorCritic(nn.Module):
    """pytorch/examples' actor-critic policy: one hidden layer, an action head and a value head."""

    def __init__(self):
        super().__init__()
        self.hidden, self.action, self.value = nn.Linear(4, 32), nn.Linear(32, 2), nn.Linear(32, 1)

    def forward(self, state):
        h = F.relu(self.hidden(state))
        return F.softmax(self.action(h), dim=-1), self.value(h)


def actor_critic(tmp_path, config):
    """pytorch/examples' actor-critic loop (one forward per action; the episode's loss the sum of -log pi times the
    advantage plus the sum of smooth_l1(value, normalised discounted return)) on a game that goes on while the
    agent picks the sign of the state's first feature, 100 actions at most: a random agent's episodes last 2
    actions, a trained one's tens, and its loss grows with them. Returns the probe and the episodes' lengths."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = ActorCritic()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    lengths = []
    with TripwireProbe(model, optimizer, config, out_dir=tmp_path / "run") as probe:
        for _ in range(300):
            saved = []
            for _ in range(100):
                state = torch.tensor(rng.normal(size=4), dtype=torch.float32)
                probabilities, value = model(state)
                choice = torch.distributions.Categorical(probabilities)
                action = choice.sample()
                saved.append((choice.log_prob(action), value))
                if int(action) != int(state[0] > 0):
                    break
            returns = torch.tensor([sum(0.99 ** k for k in range(len(saved) - t)) for t in range(len(saved))])
            returns = (returns - returns.mean()) / (returns.std(unbiased=False) + 1e-8)
            policy_losses = [-log_prob * (r - value.item()) for (log_prob, value), r in zip(saved, returns)]
            value_losses = [F.smooth_l1_loss(value, r.view(1)) for (_, value), r in zip(saved, returns)]
            loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            probe.step(loss)
            lengths.append(len(saved))
    return probe, lengths


def test_a_policy_gradient_loss_over_episodes_of_changing_length_is_not_judged_for_its_course(tmp_path):
    """The loss grows tenfold as the agent learns to play longer; pytorch/examples' actor_critic on CartPole (a port)
    got four loss_spike warnings under the default config, as its episodes went from 10 actions to 200. Its first
    step draws the actions from the policy's output, and its forward passes per step take several numbers: either
    says the loss is no measure of the fit."""
    probe, lengths = actor_critic(tmp_path, COUNTING)
    assert np.mean(lengths[-30:]) > 5 * np.mean(lengths[:30]), (np.mean(lengths[:30]), np.mean(lengths[-30:]))
    assert [v.rule for v in probe.verdicts if v.fired] == []
    not_applicable = {v.rule: v.message for v in probe.verdicts if v.status == "no_data"}
    assert set(not_applicable) == {"loss_not_decreasing", "loss_spike"}
    assert all("policy-gradient objective" in message for message in not_applicable.values())
    run = tripwire.open_run(probe.run_url)
    assert run.first_step.samples_own_output and FORWARDS in run.tensor_names("relations")


class Bandit(nn.Module):
    """pytorch/examples' reinforce.py policy (Linear, ReLU, Linear, softmax) on a contextual bandit: 8 features, 4
    arms, reward 1 for the arm a fixed linear rule picks."""

    def __init__(self):
        super().__init__()
        self.hidden, self.arms = nn.Linear(8, 64), nn.Linear(64, 4)

    def forward(self, x):
        return F.softmax(self.arms(F.relu(self.hidden(x))), dim=1)


@pytest.mark.parametrize("config", [None, "all_rules"])
def test_a_policy_gradient_loss_of_a_fixed_batch_is_not_judged_for_its_course(tmp_path, config):
    """REINFORCE with the returns normalised per batch, as pytorch/examples does: 64 actions a step, drawn from
    the policy (Categorical.sample), the loss -(log pi(a) x advantage).mean(), which has no reason to fall as the
    policy improves (its advantages are centred). A hunt found `loss_not_decreasing` 'rose since training began'
    under the default config at step 1600 (and 'stuck', an error, under every rule at step 300) while the reward
    rose from chance (0.25) to 0.97: the first step now sees the actions drawn from the model's output."""
    from benchmarks.zoo.harness import all_rules

    torch.manual_seed(0)
    rule = torch.randn(4, 8, generator=torch.Generator().manual_seed(42))
    policy = Bandit()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    rewards = []
    with TripwireProbe(policy, optimizer, all_rules("torch") if config else None, out_dir=tmp_path / "run") as probe:
        for _ in range(2000):
            x = torch.randn(64, 8)
            choice = torch.distributions.Categorical(policy(x))
            action = choice.sample()
            reward = (action == (x @ rule.t()).argmax(1)).float()
            advantage = (reward - reward.mean()) / (reward.std() + 1e-8)
            loss = (-choice.log_prob(action) * advantage).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            probe.step(loss)
            rewards.append(float(reward.mean()))
    assert np.mean(rewards[:5]) < 0.35 and np.mean(rewards[-100:]) > 0.9
    assert [(v.rule, v.finding) for v in probe.verdicts if v.counts] == []
    assert tripwire.open_run(probe.run_url).first_step.samples_own_output


@pytest.mark.parametrize("counts,told", [
    ([4] * 19 + [2], False),  # gradient accumulation over 4 batches, an epoch's short last group
    ([3] * 20, False),  # a GAN's three forwards
    ([2, 9, 14, 3, 30] * 4, True),  # episodes
], ids=["accumulation", "gan", "episodes"])
def test_forward_passes_that_take_several_numbers_over_the_first_steps_are_told_once(counts, told):
    watch = ForwardCounts()
    facts = []
    for count in counts:
        watch.this_step = count
        facts.append(watch.end_step())
    assert watch.done and facts[:-1] == [None] * (len(counts) - 1)
    assert (facts[-1] == {"value": 5.0, "min": 2.0, "max": 30.0}) if told else facts[-1] is None


def test_a_count_that_cannot_read_an_optimizer_raises_nothing_and_says_nothing():
    """The count runs in the optimizers' step hooks, where an exception would stop the user's step: an optimizer
    whose parameter groups cannot be read (a strategy's wrapper) turns it off, and the count is unknown."""

    class Unreadable:
        @property
        def param_groups(self):
            raise RuntimeError("sharded")

    objectives = Objectives([Unreadable()])
    objectives.after(Unreadable())
    objectives.before(Unreadable())
    assert objectives.count is None


def test_targets_the_model_computes_itself_are_told_apart_from_the_data_s():
    """A DQN's loss (Lightning's reinforce_learn_Qnet example: MSE against r + gamma x max Q of its target network,
    computed under no_grad and detached) against an autoencoder's (its input) and a regression's (data): only the
    first's targets are the model's own. On that example tripwire called the TD loss's growth (its targets grow as
    Q learns) a spike ten times, and 'never went down' an error. Lightning's autoencoder example passes its output
    as the target (F.mse_loss(x, self(x))), its BoringModel targets torch.ones_like(output): neither is a target
    of the model's making (the one takes a gradient, the other reads only the output's shape)."""
    torch.manual_seed(0)
    net, target_net = nn.Linear(4, 2), nn.Linear(4, 2)
    states, actions, rewards, next_states = torch.randn(16, 4), torch.randint(0, 2, (16,)), torch.randn(16), \
        torch.randn(16, 4)
    spy = LossSpy()
    with spy:
        chosen = net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            next_values = target_net(next_states).max(1)[0]
            next_values[torch.rand(16) < 0.1] = 0.0
        nn.MSELoss()(chosen, next_values.detach() * 0.99 + rewards)
        F.mse_loss(net(states)[:, 0], rewards)
        autoencoder = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
        F.mse_loss(autoencoder(states), states)
        F.mse_loss(states, autoencoder(states))  # Lightning's autoencoder example: the output in the target's place
        F.mse_loss(net(states), torch.ones_like(net(states)))  # Lightning's BoringModel: targets shaped as it
    first = spy.finish(0)
    assert [use.bootstrapped for use in first.losses] == [True, False, False, False, False]
    assert first.losses[3].output == "sigmoid" and first.losses[3].labels.shape == (16, 4)  # read the right way
    assert "computed by the model itself" in not_a_fit(first)
    assert not_a_fit(FirstStep(0, first.losses[1:])) is None


def test_targets_a_frozen_network_outside_the_model_computes_stay_put():
    """fast_neural_style's loss compares a frozen VGG's features of the output with its features of the input: the
    targets come from parameters, but from a network that never trains, so the loss level is a fit (89,000 ->
    1,500) and the loss rules judge it; they had said 'the targets move as it trains'. A frozen network inside the
    model trained, or one whose parameters take a gradient (a target network), is still the model's own."""
    torch.manual_seed(0)
    net, features = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 8, 3, padding=1)
    features.requires_grad_(False)
    images = torch.randn(4, 3, 8, 8)
    spy = LossSpy(net)
    with spy:
        F.mse_loss(features(net(images)), features(images))
    assert [use.bootstrapped for use in spy.finish(0).losses] == [False]
    model = nn.ModuleDict({"net": net, "frozen": features})
    spy = LossSpy(model)
    with spy:
        F.mse_loss(net(images), features(images)[:, :3])
        with torch.no_grad():
            target = nn.Conv2d(3, 3, 1)(images)  # a network that takes gradients elsewhere
        F.mse_loss(net(images), target)
    assert [use.bootstrapped for use in spy.finish(0).losses] == [True, True]


def td_value_learning(tmp_path, config):
    """TD(0) value learning on a ring of 20 states (rewards 0-2, gamma 0.99: values near 100), as DQN loops train:
    the target, r + gamma x V of a target network synced every 10 steps, is computed before the model's forward
    (CleanRL's and Stable-Baselines3's order). Returns the probe and the mean error of the values before and after."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    states, gamma = 20, 0.99
    features = torch.tensor(rng.normal(0, 10, (states, 10)), dtype=torch.float32)
    following, rewards = rng.permutation(states), rng.uniform(0, 2, states)
    moves = np.eye(states)[following]
    values = torch.tensor(np.linalg.solve(np.eye(states) - gamma * moves, rewards), dtype=torch.float32)
    rewards, following = torch.tensor(rewards, dtype=torch.float32), torch.tensor(following)
    net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))
    nn.init.zeros_(net[2].weight)
    nn.init.zeros_(net[2].bias)
    target_net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    error = lambda: float((net(features).squeeze(-1) - values).abs().mean())  # noqa: E731
    with torch.no_grad():
        before = error()
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        for step in range(3000):
            if step % 10 == 0:
                target_net.load_state_dict(net.state_dict())
            batch = torch.randint(0, states, (32,))
            with torch.no_grad():
                target = rewards[batch] + gamma * target_net(features[following[batch]]).squeeze(-1)
            loss = F.mse_loss(net(features[batch]).squeeze(-1), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            probe.step(loss)
    with torch.no_grad():
        return probe, before, error()


def test_a_td_target_computed_before_the_model_s_forward_is_the_model_s_own(tmp_path):
    """The values grow from 0 to 100 as they are learnt, and the TD loss and gradients with them: its first loss is
    1.1, gradient norms reach 1,300 (without knowing the targets for the model's own, exploding_gradient called them
    exploding against 1000 x the first loss, and loss_spike called the growth spikes)."""
    probe, before, after = td_value_learning(tmp_path, {**ALL_LOSS_RULES, "sampling": {"every": 1}})
    assert after < 0.1 * before, (before, after)
    assert first_step(probe.run_url).losses[0].bootstrapped
    assert [(v.rule, v.message) for v in probe.verdicts if v.fired] == []
    assert {v.rule for v in probe.verdicts if v.status == "no_data"} == {"loss_not_decreasing", "loss_spike"}


def test_the_look_armed_before_the_first_step_leaves_no_mode_behind(tmp_path):
    """The look is armed from the probe's start (the step before the first sampled one): an evaluation before
    training pays nothing for it (it waits for the training forward), and a probe closed before any step leaves no
    torch function mode on the stack."""
    from torch.overrides import _get_current_function_mode_stack
    net = nn.Linear(4, 3)
    with TripwireProbe(net, [], {"rules": ["loss_setup"]}, out_dir=tmp_path / "unused"):
        assert len(_get_current_function_mode_stack()) == 1
    assert _get_current_function_mode_stack() == []
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with TripwireProbe(net, optimizer, {"rules": ["loss_setup"]}, out_dir=tmp_path / "run") as probe:
        net.eval()
        with torch.no_grad():
            net(x)
        assert _get_current_function_mode_stack() == []
        net.train()
        for _ in range(3):
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            probe.step(loss)
        assert _get_current_function_mode_stack() == []
    (use,) = first_step(probe.run_url).losses
    assert use.loss == "cross_entropy" and use.units == 3 and not use.bootstrapped
