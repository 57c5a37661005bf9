"""A CPU replica's heap keeps the memory its forwards free (``replicas.host_heap``): the next
forward's activations reuse those pages instead of faulting fresh, zeroed ones in."""

import resource
import subprocess
import sys

import torch

from replicas.host_heap import keep_freed_memory
from tools.bench.canvas import random_llada
from tools.bench.forward import reference_logits


def faults_over_forwards(forwards: int = 5) -> int:
    """This thread's minor page faults over ``forwards`` forwards of a small random LLaDA
    (4 rows of 256 tokens, one torch thread), after one to warm up."""
    torch.set_num_threads(1)
    net = random_llada(d_model=256, layers=2, heads=4, mlp=704, vocab=320)
    ids = torch.randint(0, 320, (4, 256), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference_logits(net, ids, None)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(forwards):
            reference_logits(net, ids, None)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_a_forward_reuses_the_pages_the_one_before_freed():
    assert keep_freed_memory()  # glibc: the suite runs on Linux
    assert faults_over_forwards() < 2_000


def test_with_glibcs_first_thresholds_held_the_pages_go_back_to_the_kernel_and_fault_in_again():
    """The same forwards in a fresh process whose heap returns what it frees (glibc's initial
    thresholds, 128 KiB, held): the count the setting saves (94,000 here). glibc's own defaults
    move their thresholds as blocks are freed and land in between (6,700-30,000 here)."""
    code = ("import ctypes, sys; from replicas.host_heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD; "
            "libc = ctypes.CDLL('libc.so.6'); libc.mallopt(M_MMAP_THRESHOLD, 128 << 10); "
            f"libc.mallopt(M_TRIM_THRESHOLD, 128 << 10); sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r}); "
            "from test_host_heap import faults_over_forwards; print(faults_over_forwards())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 50_000
