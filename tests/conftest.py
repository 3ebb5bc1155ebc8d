"""Test-session settings.

pytest-xdist runs two workers on the two CI cores; with PyTorch's default of one intra-op
thread per core, each worker would spin OpenMP threads against the other and tiny models
slow down by an order of magnitude. One thread per worker keeps the suite fast and its
numbers deterministic.
"""

import os

import torch

os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(1)
