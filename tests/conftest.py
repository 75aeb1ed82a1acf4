"""Shared pytest set-up: a deliberate thread count so timings and results do not depend on the host."""

import torch

# The CI machine has 2 cores; one thread per test process keeps results reproducible
# (reduction order inside matmul kernels depends on the thread count).
torch.set_num_threads(1)
