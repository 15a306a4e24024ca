"""What each relation of training_relations says when it is broken: its severity, what broke (with {n}, the count
the plugin recorded) and the hint that names the change to make. The rule that judges them: relations.py."""

_RECOMPILE = ("Call model.compile(...) again after setting a layer's `trainable`, before the next fit (Keras' transfer "
              "learning guide: unfreeze, recompile with a low learning rate, fit).")
# relation -> (severity, what broke, the hint that names the change)
RELATIONS = {
    "stale_gradients": (
        "error",
        "{n} parameter(s) received this step's gradient on top of the previous step's: their `.grad` was not "
        "cleared after the last optimizer step, so every step applies the sum of all gradients so far",
        "Call optimizer.zero_grad() (or model.zero_grad()) once per optimizer step: before the forward pass or "
        "right after optimizer.step(). With gradient accumulation, clear them after the step that applies them."),
    "gradients_discarded": (
        "error",
        "no optimizer has stepped since training began, and the gradients of {n} parameter(s) were cleared before "
        "any optimizer applied them, at two steps in a row: optimizer.step() never runs, so the model does not "
        "train while its loss and tensors look healthy",
        "Call optimizer.step() after loss.backward() in every training step, before the next zero_grad(); check a "
        "condition around it that never holds (an accumulation count such as `(i + 1) % n == 0` with n larger than "
        "the loop), and that the optimizer handed to tripwire is the one that steps the model."),
    "eval_mode": (
        "warning",
        "the model trained this step in eval mode: {n} dropout / batch-normalisation module(s) ran as at inference "
        "(no dropout, running statistics instead of the batch's)",
        "Call model.train() before the training steps: a validation loop's model.eval() stays in force until then."),
    "train_mode_eval": (
        "warning",
        "the model was evaluated in train mode: {n} dropout / batch-normalisation module(s) ran as in training "
        "(dropout on, BatchNorm normalising with the validation batches and updating its running statistics "
        "from them), so the validation metrics are noisier than the model and the model learns from them",
        "Call model.eval() before the validation loop and model.train() after it; evaluate under torch.no_grad()."),
    "no_gradients": (
        "error",
        "an optimizer stepped while none of the {n} parameter(s) it holds had a gradient (each None or all zero): "
        "the step had nothing to apply",
        "Call optimizer.zero_grad() before the forward pass or right after optimizer.step(), never between "
        "loss.backward() and optimizer.step(); check that backward() runs before the step and that the loss "
        "reaches these parameters (not computed from detached outputs, .item() or numpy)."),
    "no_gradient_path": (
        "warning",
        "{n} parameter(s) that ran in the forward and that an optimizer steps got no gradient: a module after them "
        "received its input cut from the graph (`.detach()`, or computed under `torch.no_grad()`), so the loss "
        "cannot reach them and they never train (the training log names them and the module)",
        "Remove the `.detach()` (or the `torch.no_grad()` block) between these layers and the loss, and keep the "
        "computation in torch (not `.item()`, numpy or `.data`). If they are meant to stay fixed, set "
        "`requires_grad_(False)` on them and leave them out of the optimizer."),
    "step_changed_nothing": (
        "error",
        "an optimizer step left its {n} smallest parameter(s) with a non-zero gradient and a learning rate above 0 "
        "exactly as they were: the step applied no update",
        "The optimizer's step ran and changed nothing. Check an overridden or wrapped step() (one that returns "
        "early or writes into copies, a compiled step that does not write back)."),
    "update_rounds_away": (
        "error",
        "an optimizer step at a learning rate above 0 left its {n} smallest parameter(s) with a gradient exactly as "
        "they were, and an update of the learning rate x their largest gradient is below what their dtype can add "
        "to their values: every update rounds away, so the weights no longer train",
        "The learning rate has fallen too low for the weights' precision: a scheduler stepped more often than it "
        "was written for (StepLR or ExponentialLR stepped at every batch instead of every epoch multiplies the rate "
        "by gamma thousands of times), or a decay too steep; print optimizer.param_groups[0]['lr'] and fix the "
        "schedule. With bf16 or fp16 weights at a usual rate, keep fp32 master weights (autocast over fp32 "
        "parameters)."),
    "repeated_batch": (
        "warning",
        "the model was handed exactly the same batch at {n} steps in a row, although an epoch holds more than one: "
        "the loader repeats one batch, so the model learns that batch alone while its loss still goes down",
        "Iterate the loader once per epoch (`for batch in loader:`): a `next(iter(loader))` in the loop starts a "
        "fresh iterator at every step, which hands out the first batch again where shuffling is off. Check that "
        "the dataset's __getitem__ uses its index (a torch Dataset, a keras.utils.PyDataset), that an "
        "IterableDataset or a generator moves on."),
    "same_eval_data": (
        "warning",
        "{n} eval set(s) logged exactly the metrics of another eval set at every round so far: the same data under "
        "two names, so the validation metrics are the training metrics",
        "Pass held-out data as the validation set (xgb.train(evals=[(dtrain, 'train'), (dval, 'validation')]), "
        "eval_set=[(X_val, y_val)]): on the training data, early stopping never stops and overfitting never "
        "shows."),
    "skipped_steps": (
        "error",
        "no optimizer stepped at the last {n} steps, and the gradients hold Inf or NaN: a GradScaler skips such a "
        "step and halves its scale, so after {n} of them the gradients are not finite at any scale: the model has "
        "not been updated since, while its loss stays finite",
        "Find the operation whose backward is not finite (run one step under torch.autograd.detect_anomaly()): "
        "commonly a sqrt or a norm of an exact zero (a distance of a sample to itself: add an epsilon inside the "
        "sqrt), a log of 0, a division by a zero count. Without a GradScaler the same gradients would turn the "
        "weights to NaN."),
    "replicas_differ": (
        "error",
        "after this step's optimizer step, {n} rank(s) held parameters that differ from rank 0's: the DDP replicas "
        "drifted apart, so each rank trains a model of its own on its share of the data",
        "Call the DDP-wrapped model in the training forward (ddp_model(x), not ddp_model.module(x): only the "
        "wrapper's backward all-reduces the gradients); let DDP broadcast the initial state (wrap the model after "
        "building it the same way on every rank, load a checkpoint before wrapping, not on one rank after); never "
        "change parameters on one rank only (an update, a clamp or a load under `if rank == 0`)."),
    "schedule_never_stepped": (
        "warning",
        "{n} learning-rate scheduler(s) returned by configure_optimizers never stepped in the epochs so far (the "
        "training log names them): under manual optimisation Lightning leaves stepping them to the module, so the "
        "learning rate stays where it started",
        "Call the scheduler's step() where the schedule should move: sch = self.lr_schedulers(); sch.step() in "
        "on_train_epoch_end (or in training_step when self.trainer.is_last_batch) for a schedule per epoch, every "
        "N batches for one per step; a ReduceLROnPlateau takes the monitored value, "
        "sch.step(self.trainer.callback_metrics['val_loss'])."),
    "dropout_in_eval": (
        "warning",
        "{n} dropout function call(s) with training on ran in the first evaluation forward, the model in eval mode: "
        "F.dropout(x, p) takes training=True unless told, and model.eval() does not reach it, so the evaluation "
        "drops units at random and its metrics are worse and noisier than the model",
        "Pass the module's mode: F.dropout(x, p, training=self.training), or use an nn.Dropout module, which "
        "model.eval() turns off (a Monte Carlo dropout evaluation keeps it on on purpose)."),
    "schedule_interval": (
        "warning",
        "{n} learning-rate scheduler(s) step at an interval their schedule was not written for (the training log "
        "says how far the rate gets): a schedule counted in optimizer steps and stepped once per epoch never leaves "
        "its warmup, one counted in epochs and stepped per batch takes the rate to 0 in the first epochs",
        "Return the scheduler from configure_optimizers as {'scheduler': s, 'interval': 'step'} where its schedule "
        "counts optimizer steps (a warmup over N steps, OneCycleLR's total_steps, Transformers' "
        "get_linear_schedule_with_warmup), with 'interval': 'epoch' (Lightning's default) where it counts epochs "
        "(StepLR's step_size, CosineAnnealingLR's T_max in epochs)."),
    "rate_collapsed": (
        "warning",
        "the learning rate fell to 1% of its peak or below early in training and has stayed there for as many "
        "steps as it took to fall (the training log gives the rates and the schedulers): the model has hardly "
        "trained since, while its loss looks settled",
        "A scheduler written in epochs (StepLR's step_size, MultiStepLR's milestones, ExponentialLR's gamma) is "
        "stepped once per batch: move scheduler.step() out of the batch loop, after it, or give the schedule in "
        "optimizer steps (step_size x batches per epoch). Print optimizer.param_groups[0]['lr'] to see it."),
    "trainable_after_compile": (
        "error",
        "{n} variable(s) of layers made trainable after the model's train function was made (the training log "
        "names them) are not trained by this fit: Keras' TensorFlow train function, once traced, trains the "
        "variables it was traced with until compile() is called again",
        _RECOMPILE),
    "frozen_after_compile": (
        "error",
        "{n} variable(s) of layers frozen after the model's train function was made (the training log names them) "
        "are still trained by this fit: Keras' TensorFlow train function, once traced, trains the variables it "
        "was traced with until compile() is called again",
        _RECOMPILE),
}
