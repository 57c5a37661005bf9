"""The last decoder layer's MLP runs on the tokens whose logits are read, and the logits are
those of the whole forward at those tokens."""

import pytest
import torch

from replicas.attention import BatchLayout, paged_context
from tools.bench.forward import ARCHITECTURES

SMALL = {"llada": dict(d_model=64, layers=2, heads=4, mlp=176, vocab=500),
         "sdar": dict(hidden=64, layers=2, heads=4, vocab=500)}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_last_mlp_sees_only_the_read_tokens(name):
    build, _ = ARCHITECTURES[name]
    net = build(**SMALL[name], seed=2)
    length, spec = 24, net.spec
    ids = torch.randint(0, 500, (length,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length)

    def context():  # one packed sequence, every token seeing every token (as a refreshed LLaDA row)
        layout = BatchLayout(span_start=torch.tensor([0, length]), cache_positions=positions,
                             key_cache_positions=positions[None], key_valid=torch.ones(1, length, dtype=torch.bool),
                             span_length=length)
        cache = [torch.zeros(length, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
        return paged_context("sdpa", layout, cache, [c.clone() for c in cache], length)

    read = torch.tensor([3, 7, 8, 20])
    rows = []
    hooks = [layer.mlp.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[-2]))
             for layer in net.model.layers]
    with torch.inference_mode():
        some = net(ids, positions, context(), read)
        for hook in hooks:
            hook.remove()
        every = net(ids, positions, context())
    assert rows == [length, len(read)]  # the first layer's MLP on every token, the last's on the read ones
    torch.testing.assert_close(some, every[read], rtol=1e-5, atol=1e-5)
