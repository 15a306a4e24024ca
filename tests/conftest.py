"""Test set-up: quiet, deterministic, single-threaded frameworks; Keras kept out of the home folder."""

import atexit
import logging
import os
import shutil
import tempfile
import warnings

if "KERAS_HOME" not in os.environ:  # one for the session (its subprocesses inherit it), removed at the end
    os.environ["KERAS_HOME"] = tempfile.mkdtemp(prefix="keras-home-")
    atexit.register(shutil.rmtree, os.environ["KERAS_HOME"], True)
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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (moto) on loopback for the whole session.

    Returns a namespace with `endpoint_url`, `storage_options` (for fsspec/s3fs and tripwire's
    `storage_options=`), `env` (for subprocesses: AWS variables and TRIPWIRE_STORAGE_OPTIONS) and
    `bucket(name)`, which creates a fresh bucket and returns its `s3://name` URL.
    """
    import json
    import types
    import uuid

    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint, "NO_PROXY": "127.0.0.1,localhost",
           "TRIPWIRE_STORAGE_OPTIONS": json.dumps(options)}

    def bucket(name: str | None = None) -> str:
        import s3fs

        name = name or f"tripwire-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket=name)
        return f"s3://{name}"

    yield types.SimpleNamespace(endpoint_url=endpoint, storage_options=options, env=env, bucket=bucket)
    server.stop()
