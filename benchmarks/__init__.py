"""tripwire's benchmarks: `make bench` (= `python -m benchmarks.run`). See docs/benchmarks.md."""
