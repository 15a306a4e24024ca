"""`tripwire demo`: a small MLP on sklearn's digits, trained healthy and with injected faults.

Shows what tripwire detects, at which step, how much training an early stop
saved, and where each run is stored.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

FAULTS = {
    "healthy": "nothing wrong: SGD, lr 0.1",
    "exploding": "learning rate 50: the weights blow up to NaN",
    "dead_relu": "first-layer biases initialised to -20: every ReLU unit is dead from the start",
}
EPOCHS = 8


def run_demo(out: str) -> int:
    import lightning.pytorch as pl
    import torch

    import tripwire
    from tripwire.core.diagnosis import diagnose
    from tripwire.plugins.lightning import TripwireCallback

    warnings.filterwarnings("ignore")
    said = logging.getLogger("tripwire")  # its verdicts and diagnoses, in the demo's own output
    said.addHandler(logging.StreamHandler(sys.stdout))
    said.propagate = False
    for name in list(logging.root.manager.loggerDict):  # Lightning's banners would drown the demo's output
        if name.startswith(("lightning", "pytorch_lightning")):
            logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    torch.set_num_threads(1)

    train, val = _digits()
    config = tripwire.load_config(None).to_dict()
    config["sampling"] = {"every": 10}  # the demo runs are short: sample more often than the default 100
    config["rules"] = [dict(r, actions=[*r["actions"], "report"]) for r in config["rules"]]

    print(f"tripwire demo: an MLP on sklearn's digits, {EPOCHS} epochs per run, runs stored under {out}/\n")
    rows = []
    for fault, description in FAULTS.items():
        print(f"── {fault}: {description}", flush=True)
        pl.seed_everything(0, verbose=False)
        model = _Model(lr=50.0 if fault == "exploding" else 0.1, dead=fault == "dead_relu")
        callback = TripwireCallback(config, out_dir=f"{out}/{fault}")
        trainer = pl.Trainer(max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", callbacks=[callback])
        planned = EPOCHS * len(train)
        trainer.fit(model, train, val)  # tripwire logs each verdict as it fires, and the diagnosis at the end
        diagnoses = [d for d in diagnose(tripwire.open_run(callback.run_url).verdicts()) if d.counts]
        if not diagnoses:
            print("   nothing fired: no warning or error.")
        rows.append((fault, diagnoses, trainer.global_step, planned, callback.run_url))
        print(flush=True)

    width = max([13] + [len(_first(d)) for _, d, *_ in rows])
    print(f"{'run':10} {'diagnosis':{width}} {'causes':>6} {'steps run':>10} {'saved by stop':>14}  stored at")
    for fault, diagnoses, steps, planned, url in rows:
        saved = planned - steps
        print(f"{fault:10} {_first(diagnoses):{width}} {len(diagnoses):>6} {f'{steps}/{planned}':>10} "
              f"{f'{saved} steps' if saved else '-':>14}  {url}")
    print(f"\nEach run has an HTML report: {rows[1][4]}/report.html (open it in a browser).")
    print(f"Look closer: `tripwire show {rows[1][4]}`, `tripwire check {rows[2][4]}`, `tripwire rules dead_relu`, "
          f"`tripwire compare {rows[0][4]} {rows[1][4]}`.")
    healthy_clean = not rows[0][1]
    faults_caught = all(r[1] for r in rows[1:])
    return 0 if healthy_clean and faults_caught else 1


def _first(diagnoses) -> str:
    """The first diagnosis as the table shows it: its cause and the step it began."""
    return f"{diagnoses[0].cause} @{diagnoses[0].began}" if diagnoses else "nothing"


def _digits():
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.25, random_state=0)
    as_set = lambda a, b: torch.utils.data.TensorDataset(torch.tensor(a, dtype=torch.float32),  # noqa: E731
                                                         torch.tensor(b))
    return (torch.utils.data.DataLoader(as_set(x_train, y_train), batch_size=32, shuffle=True),
            torch.utils.data.DataLoader(as_set(x_val, y_val), batch_size=256))


def _model_class():
    import lightning.pytorch as pl
    import torch

    class Model(pl.LightningModule):
        def __init__(self, lr: float, dead: bool):
            super().__init__()
            self.lr = lr
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                           torch.nn.ReLU(), torch.nn.Linear(64, 10))
            if dead:
                torch.nn.init.constant_(self.net[0].bias, -20.0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return Model


def _Model(**kwargs):  # noqa: N802 - builds the LightningModule class only when the demo runs
    return _model_class()(**kwargs)
