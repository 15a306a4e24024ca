"""Test set-up: quiet, deterministic, single-threaded frameworks; Keras kept out of the home folder."""

import logging
import os
import tempfile
import warnings

os.environ.setdefault("KERAS_HOME", tempfile.mkdtemp(prefix="keras-home-"))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

import pytest  # noqa: E402

warnings.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _quiet_lightning():
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("lightning", "pytorch_lightning")):
            logging.getLogger(name).setLevel(logging.ERROR)
    yield
