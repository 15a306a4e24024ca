"""Small real models and data for the tests: sklearn's digits, tiny MLPs, Lightning trainers."""

from __future__ import annotations

import time

import numpy as np


def digits(n_train: int | None = None, scale: float = 1.0, minority: int | None = None, pixels: bool = False):
    """Standardised digits (x, y) split into train and validation arrays. With `minority=k`, a binary task
    (is it a 0?) where the zeros are cut down to one per k other digits; with `pixels`, not standardised but 8-bit
    pixel values (0..255), as an image loader gives them before `x / 255`."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x * 255 / 16 if pixels else (x - x.mean(0)) / (x.std(0) + 1e-6) * scale).astype(np.float32)
    if minority is not None:
        zeros = np.flatnonzero(y == 0)[: int(np.sum(y != 0) / minority)]
        keep = np.sort(np.concatenate([np.flatnonzero(y != 0), zeros]))
        x, y = x[keep], (y[keep] == 0).astype(np.int64)
    cut = int(len(x) * 0.75)
    train = (x[:cut], y[:cut]) if n_train is None else (x[:n_train], y[:n_train])
    return train, (x[cut:], y[cut:])


def torch_loaders(batch_size=32, **kwargs):
    import torch

    (xt, yt), (xv, yv) = digits(**kwargs)
    ds = lambda x, y: torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y, dtype=torch.long))  # noqa: E731
    g = torch.Generator().manual_seed(0)
    return (torch.utils.data.DataLoader(ds(xt, yt), batch_size=batch_size, shuffle=True, generator=g),
            torch.utils.data.DataLoader(ds(xv, yv), batch_size=256))


def classifier(net, lr=0.1, optimizer="sgd", momentum=0.0, pl=None):
    """A LightningModule that trains `net` (64 inputs -> 10 classes) with cross-entropy and logs val_loss."""
    import torch

    if pl is None:
        import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y)  # forward(): tripwire sees the predictions

        def validation_step(self, batch, batch_idx, dataloader_idx=0):  # one loader or several
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            if optimizer == "adam":
                return torch.optim.Adam(self.parameters(), lr=lr)
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=momentum)

    return Classifier()


def mlp_module(lr=0.1, hidden=(32,), activation="relu", optimizer="sgd", init=None, pl=None, classes=10):
    """An MLP classifier on 64 inputs. `init(net)` may break it on purpose."""
    import torch

    torch.manual_seed(0)
    act = {"relu": torch.nn.ReLU, "sigmoid": torch.nn.Sigmoid, "tanh": torch.nn.Tanh}[activation]
    layers, width = [], 64
    for h in hidden:
        layers += [torch.nn.Linear(width, h), act()]
        width = h
    net = torch.nn.Sequential(*layers, torch.nn.Linear(width, classes))
    if init is not None:
        init(net)
    return classifier(net, lr=lr, optimizer=optimizer, pl=pl)


def fit(callback, module=None, max_epochs=2, max_steps=-1, loaders=None, pl=None, callbacks=(), ckpt_path=None,
        **trainer_kwargs):
    """Train with a Lightning Trainer (lightning.pytorch unless `pl` is given); returns the trainer."""
    import torch

    if pl is None:
        import lightning.pytorch as pl
    torch.manual_seed(0)
    module = module if module is not None else mlp_module(pl=pl)
    train, val = loaders if loaders is not None else torch_loaders()
    trainer = pl.Trainer(max_epochs=max_epochs, max_steps=max_steps, enable_model_summary=False,
                         callbacks=([callback] if callback is not None else []) + list(callbacks),
                         num_sanity_val_steps=0, **{"accelerator": "cpu", "enable_checkpointing": False, "logger": False,
                                                    "enable_progress_bar": False, **trainer_kwargs})
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return trainer


def cnn_module(lr=0.05, pl=None):
    """A small CNN classifier on the 8x8 digit images."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 10))
    return classifier(net, lr=lr, momentum=0.9, pl=pl)


def probe_steps(probe, model, optimizer, x, y, steps: int, loss_fn, batch: int = 32) -> None:
    """The plain loop of the probe's tests: the first 40 batches of `batch` rows of x, y in turn, each cleared,
    run forward, back-propagated, stepped and handed to `probe.step`."""
    for step in range(steps):
        i = batch * (step % 40)
        optimizer.zero_grad()
        loss = loss_fn(model(x[i:i + batch]), y[i:i + batch])
        loss.backward()
        optimizer.step()
        probe.step(loss)


def wait_until(condition, timeout: float = 60.0) -> None:
    """Poll `condition` until it holds; fail the test if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still not true after {timeout} s: {condition}"
        time.sleep(0.01)
