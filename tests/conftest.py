"""Test-session settings.

pytest-xdist runs two workers on the two CI cores; with PyTorch's default of one intra-op
thread per core, each worker would spin OpenMP threads against the other and tiny models
slow down by an order of magnitude. So a worker takes one thread unless OMP_NUM_THREADS
says otherwise (``make test TEST_THREADS=2`` runs the suite at two: no test may depend on
the thread count, issue 22).

Inductor's compiled kernels and precompiled header are cached per CPU capability
(``ATEN_CPU_CAPABILITY``): a cache filled at AVX-512 and read back at ``default`` fails to
compile.
"""

import getpass
import os
import tempfile

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"))

import torch  # noqa: E402  (after the cache folder is chosen)

if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)
