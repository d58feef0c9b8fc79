"""Loaded by python3 on the lent GPU machines (benchmarks/gpu.sh puts this folder's copy on PYTHONPATH).

There, datasets 5.2 (carried as a wheel, with pyarrow 26 and dill 0.4.1, on Python 3.12.3) fails to
fingerprint a new in-memory Dataset: dill cannot pickle pyarrow's MonthDayNano ("it's not found as
builtins.MonthDayNano"), and `Dataset.from_dict` raises. Not seen on Python 3.11 or 3.12.1 with the same
packages. A random fingerprint is what datasets itself falls back to for transforms it cannot hash; nothing
here caches on fingerprints. (Every python3 there imports datasets at start-up, ~1 s, inside the timed
minutes.)
"""

import sys

try:
    import datasets.arrow_dataset as _arrow_dataset
    import datasets.fingerprint as _fingerprint

    _arrow_dataset.generate_fingerprint = lambda dataset: _fingerprint.generate_random_fingerprint()
except ImportError as error:
    print(f"benchmarks/gpu_site/sitecustomize.py: datasets not patched ({error})", file=sys.stderr)
