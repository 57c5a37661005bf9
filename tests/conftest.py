import torch

# One intra-op thread: the tiny model's matrices are small, and the cluster tests run
# replica processes beside this one, where competing OpenMP thread pools slow every
# forward down by orders of magnitude.
torch.set_num_threads(1)
