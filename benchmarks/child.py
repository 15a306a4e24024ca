"""Entry point of a benchmark's fresh process: `python -m benchmarks.child MODULE FUNCTION KWARGS_JSON`.

Prints the function's dict as one JSON line after `BENCH-RESULT `, the only
line the parent reads (frameworks print what they like around it).
"""

import importlib
import json
import sys

from benchmarks.common import RESULT_PREFIX

module, function, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = getattr(importlib.import_module(f"benchmarks.{module}"), function)(**kwargs)
print(RESULT_PREFIX + json.dumps(result), flush=True)
