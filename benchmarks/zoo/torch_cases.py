"""The PyTorch cases of the zoo: Lightning Trainers with tripwire's callback, and plain loops with its probe.

Healthy cases are setups users train every day: an MLP with BatchNorm, a small
ResNet, a CNN with dropout, a Transformer with warmup, an LSTM with gradient
clipping, fine-tuning a frozen backbone, a tied-embedding language model,
gradient accumulation, bf16, a GAN, a regressor, an autoencoder. Each reaches a
target on held-out data that shows it learned. Each faulty twin calls a healthy
case's builder with one real bug injected. Everything runs on the CPU, on one
thread, with fixed seeds; with TRIPWIRE_ZOO_DEVICE=cuda (`run --device cuda`)
the models, batches and GradScalers are on the GPU instead (the DDP loop stays
on the CPU, gloo).
"""

from __future__ import annotations

import contextlib
import os

import lightning.pytorch as L
import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from . import data
from .case import SILENT, Case, Outcome, should_stop

torch.set_num_threads(1)

DEVICE = torch.device(os.environ.get("TRIPWIRE_ZOO_DEVICE", "cpu"))
TRAINER = dict(accelerator="gpu" if DEVICE.type == "cuda" else "cpu", devices=1, logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0)


# -- data ---------------------------------------------------------------------------------------------------------
def loader(*arrays, batch_size: int = 32, shuffle: bool = True) -> DataLoader:
    """A DataLoader over numpy arrays, shuffled in a fixed order."""
    dataset = TensorDataset(*(torch.as_tensor(a) for a in arrays))
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(0))


def raw_pixels():
    """The digits as 8-bit pixel values (0..255) with no normalisation: what `x / 255` was forgotten on."""
    (xt, yt), (xv, yv) = data.digits(standardise=False)
    return (xt * 255 / 16, yt), (xv * 255 / 16, yv)


def with_shuffled_labels(dataset):
    """A data set whose training labels are permuted against its inputs (validation untouched)."""
    def load():
        (xt, yt), val = dataset()
        return (xt, np.random.default_rng(0).permutation(yt)), val
    return load


MIXTURE_CENTRES = np.array([[2, 2], [2, -2], [-2, 2], [-2, -2]])


def gaussian_mixture(n: int = 2048, seed: int = 0) -> np.ndarray:
    """2-D points from four Gaussians at (+-2, +-2), std 0.5 (float32 [n, 2])."""
    rng = np.random.default_rng(seed)
    centres = MIXTURE_CENTRES[rng.integers(0, len(MIXTURE_CENTRES), n)]
    return (centres + 0.5 * rng.normal(size=(n, 2))).astype(np.float32)


# -- models -------------------------------------------------------------------------------------------------------
def mlp_batchnorm() -> nn.Sequential:
    """The MLP of the bug report: Linear(64,64), BatchNorm1d, ReLU, Linear(64,10)."""
    return nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))


def mlp(activation=nn.ReLU, hidden=(128, 64), inputs: int = 64, classes: int = 10) -> nn.Sequential:
    """A plain MLP: Linear and `activation` per hidden width, then a Linear to the class logits."""
    layers, width = [], inputs
    for size in hidden:
        layers += [nn.Linear(width, size), activation()]
        width = size
    return nn.Sequential(*layers, nn.Linear(width, classes))


def cnn() -> nn.Sequential:
    """A small CNN for 8x8 digit images: two conv+ReLU+MaxPool stages, then Dropout and two Linear layers."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 2 * 2, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10))


class FunctionalCNN(nn.Module):
    """The small CNN written as pytorch/examples' mnist writes its Net: layers as modules, every ReLU, pooling and
    dropout as a function in forward (`F.relu(self.fc1(x))`)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(64 * 2 * 2, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(F.dropout(torch.flatten(x, 1), 0.25, self.training)))
        return self.fc2(F.dropout(x, 0.5, self.training))


class ResidualBlock(nn.Module):
    """A ResNet basic block (torchvision's layout): two 3x3 conv+BatchNorm, a 1x1 conv shortcut when the shape
    changes."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or channels_in != channels_out:
            self.downsample = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                            nn.BatchNorm2d(channels_out))

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + shortcut)


def resnet() -> nn.Sequential:
    """A small ResNet for 8x8 images: conv stem, three residual blocks (two downsampling), global pool, Linear."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        ResidualBlock(16, 16), ResidualBlock(16, 32, stride=2), ResidualBlock(32, 64, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def conv_backbone() -> nn.Sequential:
    """A conv feature extractor for 8x8 images: two conv+BatchNorm+ReLU+MaxPool stages, flattened (128 features)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())


class TokenTransformer(nn.Module):
    """A Transformer encoder classifier: token and learned position embeddings, padding masked, mean-pooled."""

    def __init__(self, vocab: int = 64, length: int = 16, width: int = 32, classes: int = 4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width, padding_idx=0)
        self.positions = nn.Embedding(length, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        padding = x == 0
        hidden = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        hidden = self.encoder(hidden, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * keep).sum(1) / keep.sum(1))


class TokenLSTM(nn.Module):
    """An LSTM classifier over padded token sequences (packed by length): the last hidden state to a Linear."""

    def __init__(self, vocab: int = 64, width: int = 32, hidden: int = 64, classes: int = 4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width, padding_idx=0)
        self.lstm = nn.LSTM(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        lengths = (x != 0).sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.tokens(x), lengths, batch_first=True, enforce_sorted=False)
        _, (state, _) = self.lstm(packed)
        return self.head(state[-1])


class TiedLanguageModel(nn.Module):
    """A GRU language model whose output layer shares the input embedding's weights."""

    def __init__(self, vocab: int = 32, width: int = 64):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, x):
        hidden, _ = self.gru(self.embedding(x))
        return self.head(hidden)


# -- faults injected into healthy models --------------------------------------------------------------------------
def first_layer_biases(net: nn.Sequential, value: float) -> nn.Sequential:
    """The first layer's biases all set to `value`."""
    nn.init.constant_(net[0].bias, value)
    return net


def first_layer_weights_std(net: nn.Sequential, std: float) -> nn.Sequential:
    """The first layer's weights drawn from N(0, std)."""
    nn.init.normal_(net[0].weight, std=std)
    return net


def ending_in_softmax(net: nn.Sequential) -> nn.Sequential:
    """The network with an nn.Softmax appended, so it outputs probabilities where its loss expects logits."""
    return nn.Sequential(*net, nn.Softmax(dim=1))


def middle_layer_frozen(net: nn.Sequential) -> nn.Sequential:
    """The middle Linear's parameters left with requires_grad False, as a freezing loop that reaches one layer too
    far leaves them."""
    for param in net[2].parameters():
        param.requires_grad_(False)
    return net


def linear_weights_zero(net: nn.Module) -> nn.Module:
    """Every Linear weight initialised to 0."""
    for module in net.modules():
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)
    return net


# -- optimizers ---------------------------------------------------------------------------------------------------
def adam(lr: float = 1e-3, trainable_only: bool = False):
    """configure_optimizers' body: Adam over the parameters (only those that require grad, when asked)."""
    def make(parameters):
        parameters = [p for p in parameters if p.requires_grad] if trainable_only else parameters
        return torch.optim.Adam(parameters, lr=lr)
    return make


def sgd(lr: float, weight_decay: float = 0.0):
    """configure_optimizers' body: SGD with momentum 0.9."""
    return lambda parameters: torch.optim.SGD(parameters, lr=lr, momentum=0.9, weight_decay=weight_decay)


def adamw_with_warmup(lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 50):
    """configure_optimizers' body: AdamW with a linear warmup from lr 0 over `warmup_steps`, then constant."""
    def make(parameters):
        optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}
    return make


# -- Lightning ----------------------------------------------------------------------------------------------------
class ClassifierSteps:
    """A classifier's Lightning steps as users write them: cross-entropy on `net`'s logits, train_loss, val_loss
    and val_acc logged. Mixed into a LightningModule of either Lightning distribution."""

    def __init__(self, net: nn.Module, optimizer, return_preds: bool = False):
        super().__init__()
        self.net, self.make_optimizer = net, optimizer
        self.loss = nn.CrossEntropyLoss()
        self.return_preds = return_preds

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.log("train_loss", loss)
        return {"loss": loss, "preds": logits.detach()} if self.return_preds else loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", self.loss(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


class Classifier(ClassifierSteps, L.LightningModule):
    """A `lightning.pytorch` classifier."""


class LegacyClassifier(ClassifierSteps, pl.LightningModule):
    """A `pytorch_lightning` classifier."""


class Autoencoder(L.LightningModule):
    """An MLP autoencoder: `forward` returns the reconstruction, trained on its MSE; the labels are ignored."""

    def __init__(self, features: int = 64, code: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, code))
        self.decoder = nn.Sequential(nn.Linear(code, 32), nn.ReLU(), nn.Linear(32, features))

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        loss = F.mse_loss(self(x), x)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.log("val_loss", F.mse_loss(self(x), x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class GAN(L.LightningModule):
    """A GAN on 2-D points under manual optimisation: a discriminator step, then a generator step, per batch."""

    def __init__(self, latent: int = 8):
        super().__init__()
        self.automatic_optimization = False
        self.latent = latent
        self.generator = nn.Sequential(nn.Linear(latent, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                       nn.Linear(64, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64),
                                           nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, z):
        return self.generator(z)

    lr = 1e-3

    def training_step(self, batch, batch_idx):
        (real,) = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()
        fake = self(torch.randn(len(real), self.latent, device=self.device))
        d_loss = self.discriminator_loss(self.discriminator(real), self.discriminator(fake.detach()))
        discriminator_optimizer.zero_grad()
        self.manual_backward(d_loss)
        discriminator_optimizer.step()
        g_loss = self.generator_loss(self.discriminator(fake))
        generator_optimizer.zero_grad()
        self.manual_backward(g_loss)
        generator_optimizer.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    @staticmethod
    def discriminator_loss(real_score, fake_score):
        return (F.binary_cross_entropy_with_logits(real_score, torch.ones_like(real_score))
                + F.binary_cross_entropy_with_logits(fake_score, torch.zeros_like(fake_score)))

    @staticmethod
    def generator_loss(fake_score):
        return F.binary_cross_entropy_with_logits(fake_score, torch.ones_like(fake_score))

    def configure_optimizers(self):
        betas = (0.5, 0.999)
        return (torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=betas),
                torch.optim.Adam(self.discriminator.parameters(), lr=self.lr, betas=betas))


class LogLossGAN(GAN):
    """The GAN with its losses written out by hand, -log D(x) - log(1 - D(G(z))) through a sigmoid, at a rate (5e-2)
    that lets the discriminator grow sure of itself: once a sigmoid rounds to exactly 0 or 1 in float32, a log gives
    -inf, the loss inf and every gradient after it NaN (binary_cross_entropy_with_logits computes it stably)."""

    lr = 5e-2

    @staticmethod
    def discriminator_loss(real_score, fake_score):
        return -(torch.log(torch.sigmoid(real_score)).mean() + torch.log(1 - torch.sigmoid(fake_score)).mean())

    @staticmethod
    def generator_loss(fake_score):
        return -torch.log(torch.sigmoid(fake_score)).mean()


def fit(attach, module, train: DataLoader, val: DataLoader | None, epochs: int, trainer_class=L.Trainer,
        **trainer_args) -> int:
    """Fit a LightningModule, with tripwire's callback when attached; the optimizer steps that ran."""
    callbacks = [attach.lightning()] if attach is not None else []
    trainer = trainer_class(max_epochs=epochs, callbacks=callbacks, **TRAINER, **trainer_args)
    trainer.fit(module, train, val)
    return trainer.global_step


@torch.no_grad()
def accuracy(model: nn.Module, x, y) -> float:
    """The model's accuracy on (x, y), in eval mode, on the device the model is on."""
    model.eval()
    device = next(model.parameters()).device
    predicted = model(torch.as_tensor(x, device=device)).argmax(-1)
    return (predicted == torch.as_tensor(y, device=device)).float().mean().item()


def reached(metric: str, value: float, target: float, steps: int, higher: bool = True) -> Outcome:
    """The Outcome of a run whose `metric` scored `value` against `target`."""
    learned = value >= target if higher else value <= target
    return Outcome(learned, f"{metric} {value:.3f} ({'>=' if higher else '<='} {target:g})", steps)


def train_classifier(attach, long: bool, build, optimizer, dataset=data.digits, epochs=(15, 60), batch_size: int = 32,
                     module_class=Classifier, return_preds: bool = False, **trainer_args) -> Outcome:
    """Fit `build()` as a Lightning classifier on `dataset` for epochs[long] epochs; learned: validation accuracy
    >= 0.9."""
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = dataset()
    model = module_class(build(), optimizer, return_preds=return_preds)
    steps = fit(attach, model, loader(xt, yt, batch_size=batch_size), loader(xv, yv, batch_size=256, shuffle=False),
                epochs[long], **trainer_args)
    return reached("val_acc", accuracy(model, xv, yv), 0.9, steps)


def mlp_bn(attach, long, lr=1e-3):
    """The bug report's model: Linear-BatchNorm-ReLU-Linear on standardised digits, Adam, batch 32."""
    return train_classifier(attach, long, mlp_batchnorm, adam(lr))


def mlp_lr_x1000(attach, long):
    """The bug report's model with Adam at lr 1.0, a learning rate 1000x too high."""
    return mlp_bn(attach, long, lr=1.0)


def resnet_bn(attach, long):
    """A small ResNet (BatchNorm, 1x1 downsampling shortcuts) on digit images, SGD with momentum and weight decay."""
    return train_classifier(attach, long, resnet, sgd(0.05, weight_decay=5e-4), dataset=data.digit_images,
                            epochs=(6, 30), return_preds=True)


def grad_accumulation(attach, long):
    """The bug report's model with gradients accumulated over 4 batches of 32 (an effective batch of 128)."""
    return train_classifier(attach, long, mlp_batchnorm, adam(3e-3), epochs=(32, 120), accumulate_grad_batches=4)


def bf16(attach, long):
    """The dropout CNN on digit images trained under bf16 mixed precision on the CPU."""
    return train_classifier(attach, long, cnn, adam(), dataset=data.digit_images, epochs=(8, 40),
                            precision="bf16-mixed")


def mlp_relu(attach, long, build=mlp, dataset=data.digits):
    """A two-hidden-layer ReLU MLP on standardised digits, Adam, logits returned as preds."""
    return train_classifier(attach, long, build, adam(), dataset=dataset, return_preds=True)


def dead_relu_bias(attach, long):
    """The ReLU MLP with its first layer's biases initialised to -20: every first-layer unit is dead."""
    return mlp_relu(attach, long, build=lambda: first_layer_biases(mlp(), -20.0))


def inputs_x255(attach, long):
    """The tanh MLP fed the raw 0..255 pixel values: the normalisation step was forgotten, and the first layer's
    units sit at +-1. (The ReLU MLP under Adam learns from raw pixels all the same: there they are a risk, info.)"""
    return mlp_tanh(attach, long, dataset=raw_pixels)


def softmax_into_ce(attach, long):
    """The ReLU MLP ending in nn.Softmax, trained with nn.CrossEntropyLoss, which applies log-softmax itself."""
    return mlp_relu(attach, long, build=lambda: ending_in_softmax(mlp()))


def frozen_by_mistake(attach, long):
    """The ReLU MLP with its middle Linear left frozen by a freezing loop that froze too much (the layer is still
    given to the optimizer)."""
    return mlp_relu(attach, long, build=lambda: middle_layer_frozen(mlp()))


def deep_sigmoid(attach, long):
    """The MLP built ten sigmoid layers deep: gradients vanish before they reach the first layers."""
    return mlp_relu(attach, long, build=lambda: mlp(nn.Sigmoid, hidden=(64,) * 10))


def tanh_mlp() -> nn.Sequential:
    """The two-hidden-layer MLP with tanh activations."""
    return mlp(nn.Tanh)


def mlp_tanh(attach, long, build=tanh_mlp, dataset=data.digits):
    """A two-hidden-layer tanh MLP on standardised digits, SGD with momentum."""
    return train_classifier(attach, long, build, sgd(0.01), dataset=dataset)


def tanh_saturated(attach, long):
    """The tanh MLP with its first layer's weights initialised with std 10: its units sit at +-1."""
    return mlp_tanh(attach, long, build=lambda: first_layer_weights_std(tanh_mlp(), 10.0))


def transformer_warmup(attach, long):
    """A 2-layer Transformer encoder classifier on token sequences, AdamW with weight decay and a linear warmup."""
    return train_classifier(attach, long, TokenTransformer, adamw_with_warmup(), dataset=data.token_classes,
                            epochs=(6, 30), return_preds=True)


def lstm_clip(attach, long):
    """An Embedding+LSTM classifier on padded token sequences, with the Trainer clipping gradients at norm 1."""
    return train_classifier(attach, long, TokenLSTM, adam(3e-3), dataset=data.token_classes, epochs=(6, 30),
                            gradient_clip_val=1.0)


def pretrained_backbone() -> nn.Sequential:
    """A conv backbone trained briefly (3 epochs, a plain loop) on the digit images 0-4: the 'pretrained' weights."""
    (xt, yt), _ = data.digit_images()
    keep = yt < 5
    model = nn.Sequential(conv_backbone(), nn.Linear(128, 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        for x, y in loader(xt[keep], yt[keep]):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model[0]


def other_digits():
    """The digit images of classes 5-9, relabelled 0-4: the new task a pretrained backbone is fine-tuned on."""
    (xt, yt), (xv, yv) = data.digit_images()
    train, val = yt >= 5, yv >= 5
    return (xt[train], yt[train] - 5), (xv[val], yv[val] - 5)


def frozen_backbone_model() -> nn.Sequential:
    """A backbone pretrained on digits 0-4, frozen (eval mode keeps its BatchNorm statistics), and a new head."""
    backbone = pretrained_backbone()
    backbone.requires_grad_(False)
    backbone.eval()
    return nn.Sequential(backbone, nn.Linear(128, 5))


def frozen_backbone(attach, long):
    """Fine-tuning: a conv backbone pretrained on digits 0-4 is frozen and a new head learns digits 5-9; the
    optimizer gets only the trainable parameters."""
    return train_classifier(attach, long, frozen_backbone_model, adam(trainable_only=True), dataset=other_digits,
                            epochs=(20, 80), return_preds=True)


def pl_legacy(attach, long):
    """A small MLP on the wine data set, with the `pytorch_lightning` distribution's Trainer and LightningModule."""
    return train_classifier(attach, long, lambda: mlp(hidden=(32,), inputs=13, classes=3), adam(), dataset=data.wine,
                            epochs=(60, 200), batch_size=16, module_class=LegacyClassifier, trainer_class=pl.Trainer)


def autoencoder(attach, long):
    """An MLP autoencoder (64-32-16-32-64) on standardised digits; learned: validation MSE below half the data's
    variance."""
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = data.digits()
    model = Autoencoder()
    steps = fit(attach, model, loader(xt, yt), loader(xv, yv, batch_size=256, shuffle=False), (15, 60)[long])
    model.eval()
    with torch.no_grad():
        images = torch.as_tensor(xv, device=next(model.parameters()).device)
        error = F.mse_loss(model(images), images).item()
    return reached("val_mse / variance", error / float(xv.var()), 0.5, steps, higher=False)


def gan(attach, long, module_class=GAN, epochs=(40, 120)):
    """A GAN learning a 2-D mixture of four Gaussians; learned: >= 60% of generated points within 1.0 of a mode
    (86% of real ones are) and every mode holding >= 10% of them."""
    torch.manual_seed(0)
    points = gaussian_mixture()
    model = module_class()
    steps = fit(attach, model, loader(points, batch_size=64), None, epochs[long])
    model.eval()
    with torch.no_grad():
        generated = model(torch.randn(4096, model.latent)).numpy()
    distances = np.linalg.norm(generated[:, None] - MIXTURE_CENTRES[None], axis=2)
    near = distances.min(1) < 1.0
    smallest_mode = np.bincount(distances.argmin(1)[near], minlength=len(MIXTURE_CENTRES)).min() / len(generated)
    return Outcome(bool(near.mean() >= 0.6 and smallest_mode >= 0.1), f"near a mode {near.mean():.3f} (>= 0.6), "
                   f"in the emptiest mode {smallest_mode:.3f} (>= 0.1)", steps)


# -- plain PyTorch loops ------------------------------------------------------------------------------------------
def train_loop(attach, model, optimizer, train: DataLoader, epochs: int, loss_fn, evaluate, scheduler=None,
               classifier: bool = False, zero_grad: bool = True, train_mode: bool = True,
               clear_before_step: bool = False, evaluate_first: bool = False, scaler=None,
               optimizer_step: bool = True) -> int:
    """A plain training loop, with tripwire's probe when attached: `evaluate(model)` (in eval mode) after each
    epoch, its metrics logged to the probe, and before training with `evaluate_first` (the untrained model's
    score); the backward and the step through a GradScaler where given. Returns the optimizer steps that ran.
    Four silent bugs can be put in: no `zero_grad`, `zero_grad` between `backward` and `step`
    (`clear_before_step`), no `model.train()` after the first validation, and no `optimizer.step()`."""
    steps = 0
    model.to(DEVICE)  # in place: the optimizer keeps the same parameters
    probe_or_nothing = attach.probe(model, optimizer) if attach is not None else contextlib.nullcontext()
    with probe_or_nothing as probe:
        if evaluate_first:
            validate(model, evaluate, probe)
        for epoch in range(epochs):
            if train_mode or epoch == 0:
                model.train()
            for x, y in train:
                x, y = x.to(DEVICE), y.to(DEVICE)
                if zero_grad:
                    optimizer.zero_grad()
                output = model(x)
                loss = loss_fn(output, y)
                (loss if scaler is None else scaler.scale(loss)).backward()
                if clear_before_step:
                    optimizer.zero_grad()
                if not optimizer_step:
                    pass
                elif scaler is None:
                    optimizer.step()
                else:
                    scaler.step(optimizer)
                    scaler.update()
                if scheduler is not None:
                    scheduler.step()
                steps += 1
                if probe is not None and classifier:
                    probe.step(loss, labels=y, predictions=output.detach())
                elif probe is not None:
                    probe.step(loss)
                if should_stop(attach, probe):
                    return steps
            validate(model, evaluate, probe)
    return steps


def validate(model, evaluate, probe) -> None:
    """`evaluate(model)` in eval mode, without gradients, its metrics logged to the probe where there is one."""
    model.eval()
    with torch.no_grad():
        metrics = evaluate(model)
    if probe is not None:
        probe.log_eval(metrics)


def classification_metrics(x, y, loss_fn=F.cross_entropy):
    """evaluate(model) for a classifier: val_loss and val_acc on (x, y)."""
    x, y = torch.as_tensor(x, device=DEVICE), torch.as_tensor(y, device=DEVICE)

    def evaluate(model):
        logits = model(x)
        return {"val_loss": loss_fn(logits, y).item(), "val_acc": (logits.argmax(-1) == y).float().mean().item()}
    return evaluate


class StopsUpdating(torch.optim.Adam):
    """Adam whose step does nothing after its first `working` steps: a step that silently stopped applying its
    update (a wrapper that returns early, a compiled step that does not write back)."""

    def __init__(self, params, working: int, **kwargs):
        super().__init__(params, **kwargs)
        self.working, self.calls = working, 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure) if self.calls <= self.working else None


class DetachedFeatures(nn.Module):
    """The CNN's convolutional stages and its classifier, the features handed to the classifier detached (as
    code that logs or caches them with `.detach()` and then reuses the detached copy): the convolutions never
    train, while the classifier learns what it can from their random features."""

    def __init__(self, model: nn.Sequential):
        super().__init__()
        self.features, self.classifier = model[:7], model[7:]

    def forward(self, x):
        return self.classifier(self.features(x).detach())


def cnn_dropout(attach, long, dataset=data.digit_images, optimizer_class=torch.optim.Adam, loss_fn=F.cross_entropy,
                build=cnn, **bugs):
    """A CNN with Dropout and MaxPool on digit images in a plain loop, switching train/eval for validation."""
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = dataset()
    model = build()
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    evaluate = classification_metrics(xv, yv)
    steps = train_loop(attach, model, optimizer, loader(xt, yt), (10, 40)[long], loss_fn, evaluate,
                       classifier=True, **bugs)
    return reached("val_acc", evaluate(model)["val_acc"], 0.9, steps)


def functional_cnn(attach, long):
    """The CNN with its ReLUs applied as functions (pytorch/examples' mnist style), in the plain loop."""
    return cnn_dropout(attach, long, build=FunctionalCNN)


def functional_dead_relu(attach, long):
    """The functional CNN with its dense layer's biases initialised to -20: every unit of F.relu(self.fc1(x)) is
    dead."""
    def build():
        net = FunctionalCNN()
        nn.init.constant_(net.fc1.bias, -20.0)
        return net
    return cnn_dropout(attach, long, build=build)


def spread_out(epsilon: float):
    """Cross-entropy with a small hinge that keeps outputs apart: the batch's pairwise distances below 1, computed
    as the sqrt of the squared differences. The pairs include each sample with itself, whose distance 0 has a sqrt
    with an infinite gradient (NaN once multiplied by the zero difference), unless `epsilon` is added inside."""
    def loss(logits, y):
        distances = ((logits[:, None] - logits[None]) ** 2).sum(-1).add(epsilon).sqrt()
        return F.cross_entropy(logits, y) + 1e-3 * F.relu(1 - distances).mean()
    return loss


def grad_scaler_spread(attach, long, epsilon: float = 1e-6):
    """The dropout CNN under a GradScaler (as fp16 training runs it; here in fp32) with the spread-out loss."""
    return cnn_dropout(attach, long, loss_fn=spread_out(epsilon), scaler=torch.amp.GradScaler(DEVICE.type))


def grad_scaler_skips_every_step(attach, long):
    """The spread-out loss without its epsilon: every gradient is NaN, so the GradScaler skips every step (and
    halves its scale); the loss stays finite and the model never trains."""
    return grad_scaler_spread(attach, long, epsilon=0.0)


def missing_zero_grad(attach, long):
    """The dropout CNN whose loop never calls optimizer.zero_grad(): every step applies the sum of all gradients
    so far (Adam's normalisation hides it from the loss for a while)."""
    return cnn_dropout(attach, long, zero_grad=False)


def detached_features(attach, long):
    """The dropout CNN whose classifier is handed the convolutions' features detached: they never train."""
    return cnn_dropout(attach, long, build=lambda: DetachedFeatures(cnn()))


def eval_mode_training(attach, long):
    """The dropout CNN whose loop calls model.train() once, before the first epoch: from the second epoch on, it
    trains with its dropout off, as the validation's model.eval() left it."""
    return cnn_dropout(attach, long, train_mode=False)


def zero_grad_before_step(attach, long):
    """The dropout CNN whose loop calls optimizer.zero_grad() between loss.backward() and optimizer.step(): every
    step applies nothing."""
    return cnn_dropout(attach, long, clear_before_step=True)


def optimizer_step_forgotten(attach, long):
    """The dropout CNN whose loop clears the gradients and runs the backward pass but never calls
    optimizer.step(): nothing trains, while the loss and every tensor stay at their healthy first values."""
    return cnn_dropout(attach, long, optimizer_step=False)


def step_stops_updating(attach, long):
    """The dropout CNN whose optimizer's step stops applying its update after step 50."""
    return cnn_dropout(attach, long, optimizer_class=lambda params, lr: StopsUpdating(params, 50, lr=lr))


def spectral_norm_mlp() -> nn.Sequential:
    """The ReLU MLP with spectral normalisation on its Linear layers (torch.nn.utils.spectral_norm, as GAN
    discriminators and Lipschitz-bounded classifiers use it)."""
    net = mlp()
    for i, module in enumerate(net):
        if isinstance(module, nn.Linear):
            net[i] = nn.utils.spectral_norm(module)
    return net


def spectral_norm_classifier(attach, long, evaluate_first: bool = False):
    """The spectral-norm MLP on standardised digits in a plain loop, Adam."""
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = data.digits()
    model = spectral_norm_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    evaluate = classification_metrics(xv, yv)
    steps = train_loop(attach, model, optimizer, loader(xt, yt), (8, 30)[long], F.cross_entropy, evaluate,
                       classifier=True, evaluate_first=evaluate_first)
    return reached("val_acc", evaluate(model)["val_acc"], 0.9, steps)


def spectral_norm_evaluated_first(attach, long):
    """The spectral-norm MLP evaluated before it trained: in eval mode spectral_norm divides by a norm estimated
    by power iterations that only train-mode forwards run, so the untrained model's score is off by orders of
    magnitude (a baseline, a best checkpoint or an early stop chosen from it is wrong)."""
    return spectral_norm_classifier(attach, long, evaluate_first=True)


def shuffled_labels(attach, long):
    """The dropout CNN trained on labels shuffled against their images (a data-loading bug)."""
    return cnn_dropout(attach, long, dataset=with_shuffled_labels(data.digit_images))


def next_token_loss(logits, targets):
    """Cross-entropy of a language model's logits [b, t, vocab] against the next tokens [b, t]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tied_lm(attach, long):
    """A GRU language model with tied input/output embeddings on counting token streams, Adam; learned: validation
    next-token accuracy >= 0.8 (chance 1/32; at most 0.96, as the first step of a stream cannot be predicted)."""
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = data.token_streams()
    model = TiedLanguageModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    evaluate = classification_metrics(xv, yv, next_token_loss)
    steps = train_loop(attach, model, optimizer, loader(xt, yt), (6, 30)[long], next_token_loss, evaluate)
    return reached("val_next_token_acc", evaluate(model)["val_acc"], 0.8, steps)


def r_squared(x, y):
    """evaluate(model) for a regressor: val_loss (MSE) and val_r2 on (x, y)."""
    x, y = torch.as_tensor(x, device=DEVICE), torch.as_tensor(y, device=DEVICE)

    def evaluate(model):
        mse = F.mse_loss(model(x).squeeze(-1), y).item()
        return {"val_loss": mse, "val_r2": 1 - mse / y.var(unbiased=False).item()}
    return evaluate


def linear_decay(total_steps: int):
    """A LambdaLR factor decaying linearly from 1 to 0 over `total_steps`."""
    return lambda step: (total_steps - step) / total_steps


def linear_decay_integer_division(total_steps: int):
    """The same factor written with `//`: 1 at step 0, then 0 at every step."""
    return lambda step: (total_steps - step) // total_steps


def mse_regression(attach, long, schedule=linear_decay, build=lambda: mlp(hidden=(32,), inputs=10, classes=1)):
    """An MLP regressor on the diabetes data in a plain loop: MSE, Adam with a per-step linear decay to 0; learned:
    validation R^2 >= 0.3 (a linear regression scores 0.37 on this split)."""
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = data.diabetes()
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    train, epochs = loader(xt, yt), (60, 200)[long]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(epochs * len(train)))
    evaluate = r_squared(xv, yv)
    steps = train_loop(attach, model, optimizer, train, epochs, lambda out, y: F.mse_loss(out.squeeze(-1), y),
                       evaluate, scheduler)
    return reached("val_r2", evaluate(model)["val_r2"], 0.3, steps)


def sigmoid_regression(attach, long):
    """The regressor ending in a sigmoid, for standardised targets that run from -2 to 3: it can never reach them."""
    return mse_regression(attach, long, build=lambda: nn.Sequential(*mlp(hidden=(32,), inputs=10, classes=1),
                                                                    nn.Sigmoid()))


def optimizer_misses_head(attach, long):
    """The ReLU MLP whose optimizer was built over its first layer only (as after replacing the head): the other
    layers get gradients and never change."""
    def first_layer_only(parameters):
        return torch.optim.Adam(list(parameters)[:2], lr=1e-3)

    return train_classifier(attach, long, mlp, first_layer_only)


class VAE(nn.Module):
    """pytorch/examples' VAE (fc1 400 wide, a 20-dimensional code, a sigmoid output), on 64 pixels: `forward`
    returns the reconstruction, the code's mean and its log-variance."""

    def __init__(self, pixels: int = 64, hidden: int = 400, code: int = 20):
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(pixels, hidden), nn.Linear(hidden, code), nn.Linear(hidden, code)
        self.fc3, self.fc4 = nn.Linear(code, hidden), nn.Linear(hidden, pixels)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def vae_loss(output, x):
    """pytorch/examples' VAE loss: the reconstruction's binary cross-entropy summed over the batch's pixels, plus the
    code's KL divergence from N(0, 1), summed too (a loss in the thousands, with gradients to match)."""
    reconstruction, mu, logvar = output
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return F.binary_cross_entropy(reconstruction, x, reduction="sum") + kld


def vae(attach, long):
    """The VAE on the digits' pixels scaled to [0, 1], Adam 1e-3, batches of 128, in a plain loop; learned: the
    validation reconstruction's binary cross-entropy per pixel below 0.9 x that of the mean training image."""
    torch.manual_seed(0)
    (xt, _), (xv, _) = data.digits(standardise=False)
    xt, xv = xt / 16.0, xv / 16.0
    model = VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    images = torch.as_tensor(xv, device=DEVICE)

    def evaluate(model):
        return {"val_loss": vae_loss(model(images), images).item() / images.numel()}

    steps = train_loop(attach, model, optimizer, loader(xt, xt, batch_size=128), (30, 120)[long], vae_loss,
                       evaluate)
    mean_image = torch.as_tensor(xt.mean(0), device=DEVICE).clamp(1e-4, 1 - 1e-4).expand_as(images)
    baseline = F.binary_cross_entropy(mean_image, images).item()
    model.eval()
    with torch.no_grad():
        error = F.binary_cross_entropy(model(images)[0], images).item()
    return reached("val_bce / mean image's", error / baseline, 0.9, steps, higher=False)


class DCGAN(nn.Module):
    """pytorch/examples' DCGAN, two stages deep for 8x8 images: transposed convolutions with BatchNorm and ReLU to a
    Tanh image, strided convolutions with LeakyReLU to a sigmoid score. `forward(z)` generates."""

    def __init__(self, latent: int = 16, width: int = 32):
        super().__init__()
        self.latent = latent
        self.generator = nn.Sequential(
            nn.ConvTranspose2d(latent, width * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(width * 2), nn.ReLU(True),
            nn.ConvTranspose2d(width * 2, 1, 4, 2, 1, bias=False), nn.Tanh())
        self.discriminator = nn.Sequential(
            nn.Conv2d(1, width, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(width, width * 2, 3, 1, 1, bias=False), nn.BatchNorm2d(width * 2),
            nn.LeakyReLU(0.2, inplace=True), nn.Conv2d(width * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())
        for module in self.modules():  # the example's weights_init
            if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.normal_(module.weight, 1.0, 0.02)
                nn.init.zeros_(module.bias)

    def forward(self, z):
        return self.generator(z)


def gan_loop(attach, gan: DCGAN, real_images, epochs: int, d_optimizer, g_optimizer) -> int:
    """pytorch/examples' DCGAN loop, with the probe when attached; the steps that ran."""
    steps = 0
    probe_or_nothing = attach.probe(gan, [d_optimizer, g_optimizer]) if attach is not None else \
        contextlib.nullcontext()
    with probe_or_nothing as probe:
        for _ in range(epochs):
            for (real,) in DataLoader(TensorDataset(real_images), batch_size=64, shuffle=True):
                real = real.to(DEVICE)
                fake = gan(torch.randn(len(real), gan.latent, 1, 1, device=DEVICE))
                d_optimizer.zero_grad()
                real_score, fake_score = gan.discriminator(real).view(-1), gan.discriminator(fake.detach()).view(-1)
                d_loss = F.binary_cross_entropy(real_score, torch.ones_like(real_score)) + \
                    F.binary_cross_entropy(fake_score, torch.zeros_like(fake_score))
                d_loss.backward()
                d_optimizer.step()
                g_optimizer.zero_grad()
                fake_score = gan.discriminator(fake).view(-1)
                g_loss = F.binary_cross_entropy(fake_score, torch.ones_like(fake_score))
                g_loss.backward()
                g_optimizer.step()
                steps += 1
                if probe is not None:
                    probe.step(d_loss, metrics={"g_loss": g_loss.item()})
                if should_stop(attach, probe):
                    return steps
    return steps


def dcgan(attach, long):
    """The DCGAN on the digit images scaled to [-1, 1], as pytorch/examples trains it in a plain loop: per batch a
    discriminator step on real and generated images, then a generator step, each with its own Adam (2e-4, beta1
    0.5); the probe watches both optimizers and is handed the discriminator's loss, the generator's as a metric.
    Learned: the generated images' mean image within 0.1 (mean squared) of the real one and their pixels spread
    at least half as widely."""
    torch.manual_seed(0)
    (xt, _), _ = data.digits(standardise=False)
    real_images = torch.as_tensor(xt.reshape(-1, 1, 8, 8) / 8.0 - 1.0)
    gan = DCGAN().to(DEVICE)
    d_optimizer = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    g_optimizer = torch.optim.Adam(gan.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    steps = gan_loop(attach, gan, real_images, (25, 100)[long], d_optimizer, g_optimizer)
    gan.eval()
    with torch.no_grad():
        generated = gan(torch.randn(1024, gan.latent, 1, 1, device=DEVICE)).cpu()
    mean_error = float(((generated.mean(0) - real_images.mean(0)) ** 2).mean())
    spread = float(generated.std(0).mean() / real_images.std(0).mean())
    return Outcome(bool(mean_error < 0.1 and spread >= 0.5), f"mean image error {mean_error:.3f} (< 0.1), pixel "
                   f"spread {spread:.2f} of the real images' (>= 0.5)", steps)


class FirstSampleOnly(torch.utils.data.Dataset):
    """A dataset whose __getitem__ forgets its index: every batch is the first sample, again and again."""

    def __init__(self, x, y):
        self.x, self.y = torch.as_tensor(x), torch.as_tensor(y)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[0], self.y[0]


def index_ignored(attach, long):
    """The ReLU MLP trained from a dataset whose __getitem__ ignores its index: the loss goes to 0 on the one
    sample it sees at every step."""
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = data.digits()
    model = Classifier(mlp(), adam(), return_preds=True)
    train = DataLoader(FirstSampleOnly(xt, yt), batch_size=32, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    steps = fit(attach, model, train, loader(xv, yv, batch_size=256, shuffle=False), (15, 60)[long])
    return reached("val_acc", accuracy(model, xv, yv), 0.9, steps)


def ddp(attach, long, bypass: bool = False):
    """The ReLU MLP in a plain DDP loop, two processes on the CPU (gloo), a probe on each rank (`workers: all`, as
    docs/probe.md asks for DDP); learned: rank 0's validation accuracy >= 0.9."""
    import json
    import subprocess
    import sys
    import tempfile

    import tripwire

    folder = attach.out_dir if attach is not None else os.path.join(tempfile.mkdtemp(prefix="zoo-ddp-"), "run")
    config = tripwire.load_config(attach.config if attach is not None else None).to_dict()
    config["workers"] = "all"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get(
        "PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                    "benchmarks.zoo.ddp_loop", folder, json.dumps(config), str((6, 20)[long]),
                    *(["--bypass"] if bypass else [])], check=True, capture_output=True, timeout=600, env=env,
                   cwd=root)
    with open(f"{folder}-result.json") as f:
        result = json.load(f)
    if attach is not None:
        attach.run_url = result["run_url"]
    return reached("val_acc", result["accuracy"], 0.9, result["steps"])


def ddp_bypass(attach, long):
    """The DDP loop whose training forward calls the inner module (`ddp_model.module(x)`): no all-reduce follows
    the backward, so each rank trains a model of its own on its half of the data."""
    return ddp(attach, long, bypass=True)


class ManualClassifier(Classifier):
    """The classifier under manual optimisation: its training_step clears, back-propagates and steps itself."""

    def __init__(self, net: nn.Module, optimizer, return_preds: bool = False):
        super().__init__(net, optimizer, return_preds)
        self.automatic_optimization = False


class ClearsBeforeStep(ManualClassifier):
    """Manual optimisation as users write it, with optimizer.zero_grad() between the backward pass and the step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        loss = self.loss(self(x), y)
        self.manual_backward(loss)
        optimizer.zero_grad()
        optimizer.step()
        self.log("train_loss", loss)


class ForgetsStep(ManualClassifier):
    """Manual optimisation whose training_step clears and back-propagates but never calls optimizer.step()."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.optimizers().zero_grad()
        loss = self.loss(self(x), y)
        self.manual_backward(loss)
        self.log("train_loss", loss)


def gan_log_loss(attach, long):
    """The GAN whose hand-written log losses go inf at global step 28 (the 15th batch's discriminator loss: each
    batch steps both optimizers, and Lightning counts both)."""
    return gan(attach, long, LogLossGAN, epochs=(3, 6))


def manual_step_forgotten(attach, long):
    """The ReLU MLP under manual optimisation whose training_step never calls optimizer.step() (Lightning counts
    optimizer steps: its step stays at 0)."""
    return train_classifier(attach, long, mlp, adam(), module_class=ForgetsStep)


def manual_zero_grad_before_step(attach, long):
    """The ReLU MLP under manual optimisation whose zero_grad() sits between manual_backward() and step()."""
    return train_classifier(attach, long, mlp, adam(), module_class=ClearsBeforeStep)


def lr_zero_schedule(attach, long):
    """The regressor whose linear-decay factor uses integer division: the learning rate is 0 after the first step."""
    return mse_regression(attach, long, schedule=linear_decay_integer_division)


def breast_cancer_mlp() -> nn.Sequential:
    """An MLP for the breast cancer data: 30 features, two hidden layers of 64, two class logits."""
    return mlp(hidden=(64, 64), inputs=30, classes=2)


def cosine_label_smoothing(attach, long, build=breast_cancer_mlp):
    """An MLP on the breast cancer data in a plain loop: AdamW with weight decay, CosineAnnealingLR per step,
    cross-entropy with label smoothing 0.1."""
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = data.breast_cancer()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    train, epochs = loader(xt, yt), (40, 150)[long]
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(train))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    evaluate = classification_metrics(xv, yv, loss_fn)
    steps = train_loop(attach, model, optimizer, train, epochs, loss_fn, evaluate, scheduler, classifier=True)
    return reached("val_acc", evaluate(model)["val_acc"], 0.93, steps)


def zero_init(attach, long):
    """The breast cancer MLP with every Linear weight initialised to 0: a symmetric start, where no gradient reaches
    a layer until the layer after it has grown non-zero weights."""
    return cosine_label_smoothing(attach, long, build=lambda: linear_weights_zero(breast_cancer_mlp()))


CASES: list[Case] = [
    Case("lightning", "mlp_bn", mlp_bn),
    Case("lightning", "resnet_bn", resnet_bn),
    Case("lightning", "transformer_warmup", transformer_warmup),
    Case("lightning", "lstm_clip", lstm_clip),
    Case("lightning", "frozen_backbone", frozen_backbone),
    Case("lightning", "grad_accumulation", grad_accumulation),
    Case("lightning", "bf16", bf16),
    Case("lightning", "gan", gan),
    Case("lightning", "autoencoder", autoencoder),
    Case("lightning", "mlp_relu", mlp_relu),
    Case("lightning", "mlp_tanh", mlp_tanh),
    Case("lightning", "pl_legacy", pl_legacy),
    Case("torch", "cnn_dropout", cnn_dropout),
    Case("torch", "tied_lm", tied_lm),
    Case("torch", "mse_regression", mse_regression),
    Case("torch", "cosine_label_smoothing", cosine_label_smoothing),
    Case("torch", "vae", vae),
    Case("torch", "dcgan", dcgan),
    Case("torch", "functional_cnn", functional_cnn),
    Case("torch", "functional_dead_relu", functional_dead_relu, fault="F.relu after a dense layer whose biases are "
         "-20: dead ReLUs", catch=("dead_relu",)),
    Case("lightning", "mlp_lr_x1000", mlp_lr_x1000, fault="lr x1000 (Adam 1.0)",
         catch=("exploding_tensor", "weight_update_ratio", "exploding_gradient", "dead_relu", "loss_not_decreasing",
                "learning_rate"), cause=("learning_rate", "weight_update_ratio", "exploding_gradient")),
    Case("lightning", "dead_relu_bias", dead_relu_bias, fault="first-layer biases -20: dead ReLUs",
         catch=("dead_relu",)),
    Case("lightning", "inputs_x255", inputs_x255, fault="raw 0..255 pixels, not normalised",
         catch=("input_not_normalized",)),
    Case("lightning", "softmax_into_ce", softmax_into_ce, fault="Softmax output into CrossEntropyLoss",
         catch=("loss_setup", "output_loss_mismatch")),
    Case("lightning", "frozen_by_mistake", frozen_by_mistake, fault="middle Linear frozen by mistake",
         catch=("unchanged_tensor", "untrained_parameters"), tags=SILENT),
    Case("lightning", "deep_sigmoid", deep_sigmoid, fault="10 sigmoid layers: vanishing gradients",
         catch=("vanishing_gradient",)),
    Case("lightning", "tanh_saturated", tanh_saturated, fault="first-layer weights std 10: saturated tanh",
         catch=("saturated_activation", "poor_weight_initialization")),
    Case("torch", "shuffled_labels", shuffled_labels, fault="labels shuffled against inputs",
         catch=("loss_not_decreasing", "overfit")),
    Case("torch", "lr_zero_schedule", lr_zero_schedule, fault="LambdaLR factor 0 after step 0 (integer division)",
         catch=("learning_rate", "unchanged_tensor", "weight_update_ratio", "loss_not_decreasing"), onset=1,
         cause=("unchanged_tensor", "weight_update_ratio", "learning_rate"), tags=SILENT),
    Case("torch", "sigmoid_regression", sigmoid_regression, fault="sigmoid output for targets from -2 to 3",
         catch=("loss_setup",)),
    Case("lightning", "optimizer_misses_head", optimizer_misses_head,
         fault="optimizer built over the first layer only", catch=("untrained_parameters",), tags=SILENT),
    Case("torch", "detached_features", detached_features,
         fault="the classifier's input detached from the convolutions", catch=("training_relations",), onset=1,
         tags=SILENT),
    Case("torch", "missing_zero_grad", missing_zero_grad, fault="optimizer.zero_grad() never called",
         catch=("training_relations",), onset=1, tags=SILENT),
    Case("torch", "eval_mode_training", eval_mode_training, fault="no model.train() after the first validation",
         catch=("training_relations",), onset=43, tags=SILENT),  # the second epoch: 1347 images in batches of 32
    Case("torch", "zero_grad_before_step", zero_grad_before_step,
         fault="optimizer.zero_grad() between backward() and step()", catch=("training_relations",), tags=SILENT),
    Case("torch", "step_stops_updating", step_stops_updating, fault="optimizer.step() a no-op after step 50",
         catch=("training_relations",), onset=50, tags=SILENT),
    # step 0 runs as in the fixed loop; step 1's forward is the first with weights a step should have changed
    Case("torch", "optimizer_step_forgotten", optimizer_step_forgotten, fault="optimizer.step() never called",
         catch=("training_relations",), onset=1, tags=SILENT),
    Case("lightning", "manual_zero_grad_before_step", manual_zero_grad_before_step,
         fault="manual optimisation: zero_grad() between manual_backward() and step()",
         catch=("training_relations",), tags=SILENT),
    Case("lightning", "gan_log_loss", gan_log_loss,
         fault="GAN losses as log(sigmoid) by hand at lr 5e-2: log(0) once the discriminator saturates",
         catch=("exploding_tensor",), onset=28),
    Case("lightning", "manual_step_forgotten", manual_step_forgotten,
         fault="manual optimisation: optimizer.step() never called", catch=("training_relations",),
         tags=SILENT),
    Case("lightning", "index_ignored", index_ignored, fault="the dataset's __getitem__ ignores its index",
         catch=("training_relations",), cause=("training_relations", "loss_setup"), onset=1, tags=SILENT),
    Case("torch", "ddp", ddp),
    Case("torch", "ddp_bypass", ddp_bypass, fault="DDP forward through ddp_model.module: replicas drift apart",
         catch=("training_relations",), tags=SILENT),
    Case("torch", "grad_scaler_spread", grad_scaler_spread),
    Case("torch", "grad_scaler_skips_every_step", grad_scaler_skips_every_step,
         fault="sqrt of a zero distance under a GradScaler: every step skipped", catch=("training_relations",),
         onset=29, tags=SILENT),  # healthy fp16 training skips its first steps too: the 30th in a row is the fault
    Case("torch", "spectral_norm_classifier", spectral_norm_classifier),
    Case("torch", "spectral_norm_evaluated_first", spectral_norm_evaluated_first,
         fault="spectral_norm model evaluated before any training forward", catch=("first_evaluation",), tags=SILENT),
    Case("torch", "zero_init", zero_init, fault="every Linear weight initialised to 0",
         catch=("poor_weight_initialization", "all_zero")),
]
