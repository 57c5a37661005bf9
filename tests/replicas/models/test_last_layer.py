"""The last decoder layer's MLP runs on the tokens whose logits are read, and the logits are
those of the whole forward at those tokens."""

import pytest
import torch

from replicas.attention import BatchLayout, paged_context
from replicas.models.checkpoint import load_model
from tests.replicas.models.checkpoint_builders import CHECKPOINTS, OVERRIDES, write_checkpoint
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


def _paged():
    """Three spans as a block-causal step over a cache lays them out: pages of 4, the second
    unit 3 tokens (a prompt's tail), each seeing the pages up to its own (its new tokens are
    written to the cache first, then read back with the earlier ones)."""
    page = 4
    span_start = torch.tensor([0, 4, 7, 11])
    cache_positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11])
    key_cache_positions = torch.arange(12).expand(3, 12)
    key_valid = torch.arange(12) < torch.tensor([[4], [8], [12]])
    key_valid[:, 7] = False  # the second page's unused slot
    layout = BatchLayout(span_start=span_start, cache_positions=cache_positions,
                         key_cache_positions=key_cache_positions, key_valid=key_valid)
    return layout, page


@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
def test_the_last_layer_attends_with_the_read_tokens_queries_alone(tmp_path, arch):
    """Given the read tokens, the last layer projects and attends the queries of those alone
    (every token's K and V still written and read): the logits are the whole forward's, for
    spans read in any order, twice, or not at all (Dream's shifted reads take token 0 again),
    over a cache (fused QKV and QK-norm included: LLaDA2.0, SDAR)."""
    net = load_model(write_checkpoint(tmp_path / arch, arch), overrides=OVERRIDES[arch])
    spec = net.spec
    ids = torch.randint(0, 250, (11,), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    read = torch.tensor([7, 0, 8, 0, 10, 9])  # the third span's, then the first's, unordered and repeated

    def context(kept):
        layout, page = _paged()
        cache = [torch.zeros(12, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
        return paged_context("sdpa", layout, cache, [c.clone() for c in cache], page, kept)

    queries = []
    last = net.model.layers[-1].self_attn
    projection = last.q_proj if hasattr(last, "q_proj") else last.o_proj
    hook = projection.register_forward_hook(lambda module, args, out: queries.append(args[0].shape[0]))
    with torch.inference_mode():
        narrowed = net(ids, positions, context(read), read)
        hook.remove()
        whole = net(ids, positions, context(None))
    assert queries == [len(read)]  # the last layer's query (or output) projection on the read tokens alone
    torch.testing.assert_close(narrowed, whole[read], rtol=1e-5, atol=1e-5)
