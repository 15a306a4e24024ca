"""What only a GPU can run: Lightning's FSDPStrategy (FSDP1 refuses a CPU), fp16 mixed precision with its
GradScaler, a NaN loss and a step that stopped updating, read as an accelerator's values are (a step late, so that no
step waits for the device).
Skipped where torch sees no CUDA GPU (CI has none); a session lent one runs them (docs/benchmarks.md)."""

import lightning.pytorch as pl
import pytest
import torch

import helpers
import test_origin
import test_relations
import tripwire
from tripwire.plugins.lightning import TripwireCallback

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")

STEP = 100  # a step the default config samples weights and gradients at


class GradientAt(pl.Callback):
    """The gradient of `net.0.weight` at STEP as the optimizer is handed it (after Lightning removed the loss
    scale), for the tests to compare what tripwire stored with."""

    value = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == STEP:
            grad = pl_module.net[0].weight.grad
            self.value = {"l2": float(grad.norm()), "abs_mean": float(grad.abs().mean())}


@pytest.mark.parametrize("trainer_kwargs", [{"strategy": "fsdp"}, {"precision": "16-mixed"}],
                         ids=["fsdp", "16-mixed"])
def test_a_healthy_lightning_run_on_a_gpu_stores_the_gradient_the_optimizer_gets_and_is_silent(tmp_path,
                                                                                               trainer_kwargs):
    """FSDP1 (one rank: the flat parameter's views, named as the module names them) and fp16 under a GradScaler
    (the gradient judged after the scale is removed): the gradient stored at STEP is the one the optimizer was
    handed, the model learns, and the default rules fire no warning or error."""
    callback, seen = TripwireCallback(out_dir=tmp_path / "run"), GradientAt()
    try:
        trainer = helpers.fit(callback, helpers.mlp_module(), max_epochs=1000, max_steps=STEP + 20,
                              accelerator="gpu", devices=1, callbacks=[seen], **trainer_kwargs)
    finally:
        if torch.distributed.is_initialized():  # FSDP's process group (one rank), left by Lightning
            torch.distributed.destroy_process_group()
    assert float(trainer.callback_metrics["val_loss"]) < 0.8  # from ln 10 = 2.3 untrained (0.51 on the CPU)
    run = tripwire.open_run(callback.run_url)
    assert [v for v in run.verdicts() if v.counts] == []
    assert "gradients/net.0.weight" in run.tensor_names()
    assert not [n for n in run.tensor_names() if "flat_param" in n or "_fsdp" in n]
    stored = {r: run.tensor("gradients/net.0.weight").reduction(STEP, r) for r in ("l2", "abs_mean")}
    assert stored == pytest.approx(seen.value, rel=1e-4)


def nan_verdicts(run_url):
    return [v for v in tripwire.open_run(run_url).verdicts() if v.rule == "exploding_tensor" and v.counts]


@pytest.mark.parametrize("steps", [40, 14], ids=["mid-run", "at the last step"])
def test_a_nan_loss_on_a_gpu_is_told_at_its_step_by_the_probe(tmp_path, steps):
    """The NaN at step 13 is told as step 13's, within a step of it (training stops at once after), and where
    step 13 is the last, when training ends: no later step reads it."""
    probe, losses = test_origin.probe_fit(tmp_path / "run", scale_input_at=13, steps=steps, device="cuda")
    assert [v.step for v in nan_verdicts(probe.run_url)] == [13]
    assert len(losses) <= 15


@pytest.mark.parametrize("working", [None, 15])
def test_a_step_that_stops_updating_on_a_gpu_is_told_within_a_step(tmp_path, working):
    """The every-step check that an optimizer step changed its witness, read late on the GPU (no step waits for
    it): silent on a healthy run, and the first no-op step's second in a row (16, unsampled) told as step 16's."""
    module = helpers.mlp_module()
    module.configure_optimizers = lambda: test_relations.ComputesButStopsUpdating(module.parameters(),
                                                                                   working or 10 ** 9)
    callback = TripwireCallback(test_relations.CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, module, max_epochs=2, accelerator="gpu", devices=1)
    run = tripwire.open_run(callback.run_url)
    if working is None:
        assert trainer.callback_metrics["val_loss"] < 0.8 and test_relations.findings(run) == []
    else:
        assert test_relations.findings(run) == [("step_changed_nothing", 16, "error")]


def test_a_nan_loss_at_the_last_step_on_a_gpu_is_told_in_lightning(tmp_path):
    callback = TripwireCallback(out_dir=tmp_path / "run")
    helpers.fit(callback, test_origin.lightning_module(nan_step=12, where="loss"), max_epochs=1, max_steps=13,
                accelerator="gpu", devices=1)
    assert [v.step for v in nan_verdicts(callback.run_url)] == [12]
