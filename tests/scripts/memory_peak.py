"""Peak process memory (RSS) of a plain PyTorch loop, with or without a TripwireProbe that saves the full weights and
gradients of every step into slow object storage. Prints one JSON line: the peak over the memory after warm-up,
in MiB, the parameters' bytes, and (with tripwire) what the run holds.

    python memory_peak.py plain|tripwire MAX_QUEUE_MB STEPS
"""

import gc
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(mode: str, queue_mb: float, steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    peak = [0.0]

    def sample():
        while True:
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.002)

    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 512))  # 4.7M parameters, 18 MiB
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1024), torch.randn(64, 512)

    def train_step():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(3):  # warm up: the loop's own memory is in the baseline
        train_step()
    probe = None
    if mode == "tripwire":
        import flakyfs
        from tripwire.plugins.torch import TripwireProbe

        def slow_discarding_put(self, path, value, **kwargs):
            if "/shards/" in path:  # an object store that takes 0.02 s per MiB and keeps nothing in this process
                time.sleep(0.02 * len(value) / (1 << 20))
                return None
            return flakyfs.MemoryFileSystem.pipe_file(self, path, value, **kwargs)

        flakyfs.FlakyFileSystem.pipe_file = slow_discarding_put
        config = {"sampling": {"every": 1}, "writer": {"max_queue_mb": queue_mb},
                  "collections": {"weights": {"save": "tensors"}, "gradients": {"save": "tensors"}, "losses": {}}}
        probe = TripwireProbe(model, optimizer, config, out_dir=f"flaky://memory/run-{time.monotonic_ns()}")
    gc.collect()
    base = rss_mib()
    peak[0] = base
    threading.Thread(target=sample, daemon=True).start()
    for _ in range(steps):
        loss = train_step()
        if probe is not None:
            probe.step(loss)
    result = {"peak_over_base_mib": peak[0] - base,
              "parameter_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / (1 << 20)}
    if probe is not None:
        writer = probe._recorder.writer
        result.update(dropped=writer.dropped_steps, partial=getattr(writer, "partial_steps", None))
        probe.close()
        import tripwire

        result["losses_stored"] = len(tripwire.open_run(probe.run_url).tensor("losses/train").steps())
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
