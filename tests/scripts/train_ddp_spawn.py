"""Two-process Lightning DDP on CPU started by `ddp_spawn`: the Trainer, the module and tripwire's callback are
pickled into each process (they must be picklable), which re-imports this file (hence the main guard).

usage: train_ddp_spawn.py RUN_URL
Prints "learned BEFORE AFTER": the validation loss of the untrained and of the trained module, on rank 0's copy
that the launcher hands back.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import helpers  # noqa: E402

# spawned processes receive the loaders' tensors through files (this sandbox refuses the file-descriptor way)
torch.multiprocessing.set_sharing_strategy("file_system")


class Classifier(pl.LightningModule):
    """At module level: a spawned process finds the class by its name."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def validation_loss(trainer, module, loader) -> float:
    return float(trainer.validate(module, loader, verbose=False)[0]["val_loss"])


if __name__ == "__main__":
    from tripwire.plugins.lightning import TripwireCallback

    train, val = helpers.torch_loaders()
    module = Classifier()
    plain = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False)
    before = validation_loss(plain, module, val)
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[TripwireCallback(out_dir=sys.argv[1])])
    trainer.fit(module, train, val)
    print("learned", before, validation_loss(plain, module, val))
