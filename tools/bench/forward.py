"""`dllm-serve bench forward`: the engine's forward against a plain reference forward of the
same weights, per architecture and canvas, at each batch size.

The reference (``reference_logits``) is the published models' math written out densely,
the way their generate() functions run it without a cache: embedding; per layer an RMSNorm
in float32, the q/k/v projections (with SDAR's per-head q/k RMSNorm), rotate-half rotary,
SDPA over the whole sequence under the architecture's mask (none for LLaDA, block-causal
for SDAR), the output projection and residual, an RMSNorm, SwiGLU and residual; the final
norm and the LM head over every position. It shares the project's weights (read by
parameter name), not its code.

Each configuration runs the engine without a KV cache (``kv_cache: none``: every forward
recomputes each row's sequence, as the published generate() does without one) on random
weights with ``fixed_steps``, recording every forward's seconds and tokens, and runs the
reference forward of the same ids beside each one, before and after it in turn. The ratio
(project / reference forward seconds; under 1 is faster) is the median over every pair of
every round, with its quartiles: a shared CPU's speed drifts by tens of percent within
seconds, and a pair's two forwards see the same moment. Random weights: what is measured is the work, not the answers. Both sides run on
the bench's device and are timed alike (``replicas.runner.ForwardTimer``: CUDA events on
a GPU, the wall clock on a CPU).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from tools.bench.canvas import IdsOnly, random_llada
from tools.bench.device import BenchDevice
from tools.bench.prefix import random_sdar
from replicas.engine import Engine
from replicas.messages import SamplingParams
from replicas.models.transformer import DecoderLM
from replicas.runner import ForwardTimer

# architecture -> (model builder, canvas): LLaDA on its full canvas, SDAR block by block
ARCHITECTURES = {"llada": (random_llada, "full"), "sdar": (random_sdar, "block")}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The published RMSNorm: in float32, back to the input dtype, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """Rotate-half rotary over the first ``dim`` of each head (``x[B, H, S, D]``)."""
    turned, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    out = turned * cos + torch.cat([-turned[..., half:], turned[..., :half]], -1) * sin
    return torch.cat([out, rest], -1) if rest.shape[-1] else out


@torch.inference_mode()
def reference_logits(net: DecoderLM, ids: torch.Tensor, block_causal: int | None) -> torch.Tensor:
    """Logits ``[B, S, V]`` of ``ids[B, S]`` at positions 0..S-1, every position attending to
    every other (``block_causal=None``) or to its own and earlier blocks of that size. For
    the dense SwiGLU architectures with separate q/k/v projections (LLaDA, Dream, SDAR)."""
    shape, body = net.shape, net.model
    batch, length = ids.shape
    positions = torch.arange(length, device=ids.device)
    mask = None
    if block_causal is not None:
        block = positions // block_causal
        mask = block[None, :] <= block[:, None]
    dim = shape.rotary_dim or shape.head_dim
    inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=ids.device) / dim)
    angles = positions[:, None].float() * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    eps = shape.rms_norm_eps
    x = F.embedding(ids, body.embed_tokens.weight)
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms(x, layer.input_layernorm.weight, eps)

        def heads(projection: torch.nn.Linear, count: int) -> torch.Tensor:
            return F.linear(h, projection.weight, projection.bias).view(batch, length, count, -1).transpose(1, 2)

        q, k, v = heads(attn.q_proj, shape.num_heads), heads(attn.k_proj, shape.num_kv_heads), heads(
            attn.v_proj, shape.num_kv_heads)
        if shape.qk_norm:
            q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)
        q, k = _rotate(q, cos.to(q.dtype), sin.to(q.dtype), dim), _rotate(k, cos.to(k.dtype), sin.to(k.dtype), dim)
        if shape.num_kv_heads != shape.num_heads:
            repeat = shape.num_heads // shape.num_kv_heads
            k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + F.linear(out.transpose(1, 2).reshape(batch, length, -1), attn.o_proj.weight)
        h = _rms(x, layer.post_attention_layernorm.weight, eps)
        x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                         mlp.down_proj.weight)
    x = _rms(x, body.norm.weight, eps)
    head = body.embed_tokens.weight if shape.tie_word_embeddings else net.lm_head.weight
    return F.linear(x, head)


def project_forwards(net: DecoderLM, canvas: str, batch: int, prompt_len: int, max_tokens: int,
                     steps: int, place: BenchDevice = BenchDevice(),
                     paired: bool = False) -> list[tuple[float, float | None, int]]:
    """(seconds, reference seconds, tokens per row) of every forward the engine runs for
    ``batch`` requests at once (the tokens each row feeds, as the runner built them: without
    a cache, its sequence). ``paired``: each forward has the reference forward of the same
    ids run right before it or right after it, in turn (so both sides see the same input
    values and the machine's same moment: a shared CPU's speed drifts by tens of percent
    within seconds); else the reference seconds are None."""
    engine = Engine(net, IdsOnly(), place.engine_config(
        net.spec, max_batch=batch, canvas=canvas, kv_cache="none", fdfo_fill_hold=False,
        max_model_len=prompt_len + max_tokens + 64, algorithm="fixed_steps", algorithm_params={"steps": steps}))
    prompts = [[1 + (i * 37 + r * 101) % (net.shape.vocab_size // 2) for i in range(prompt_len)] for r in range(batch)]
    block = None if canvas == "full" else net.spec.block_length
    lengths, seconds, reference = [], [], []
    build = engine.runner.build_inputs

    def time_reference(ids: torch.Tensor) -> None:
        timer = ForwardTimer(ids.device)
        reference_logits(net, ids, block)
        reference.append(timer.stop().seconds())

    def recording(scheduled, refreshed):
        inputs = build(scheduled, refreshed)
        lengths.append(inputs[0].numel() // scheduled.num_rows)
        if paired:
            rows = inputs[0].view(scheduled.num_rows, -1).to(next(net.parameters()).device)
            if len(lengths) % 2:
                time_reference(rows)
            else:  # after the forward, once the step has read its results
                after.append(rows)
        return inputs

    after: list[torch.Tensor] = []

    def on_step(stats) -> None:
        if stats.forward_s:
            seconds.append(stats.forward_s)
        while after:
            time_reference(after.pop())

    engine.runner.build_inputs = recording
    with torch.inference_mode():
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), on_step=on_step)
    return list(zip(seconds, reference if paired else [None] * len(seconds), lengths, strict=True))


def reference_forwards(net: DecoderLM, canvas: str, batch: int, shapes: list[int]) -> list[float]:
    """Seconds of the reference forward at each sequence length in ``shapes``, on the
    model's device, timed as the engine times its forwards (the bench's warm-up)."""
    block = None if canvas == "full" else net.spec.block_length
    device = next(net.parameters()).device
    seconds = []
    for length in shapes:
        ids = torch.randint(0, net.shape.vocab_size, (batch, length), device=device)
        timer = ForwardTimer(device)
        with torch.inference_mode():
            reference_logits(net, ids, block)
        seconds.append(timer.stop().seconds())
    return seconds


def bench_forward(architectures=("llada", "sdar"), batch_sizes=(1, 8), prompt_len: int = 64,
                  max_tokens: int = 128, steps: int = 4, rounds: int = 3, device: str = "cpu",
                  dtype: str | None = None, **shape) -> dict:
    """The report per architecture and batch size; ``shape``: each architecture's builder's
    keywords (``llada=dict(d_model=...)``, ``sdar=dict(hidden=...)``). Both sides run on
    ``device`` in ``dtype`` (None: bfloat16 on CUDA, float32 on a CPU)."""
    place = BenchDevice(device, dtype)
    report = {"prompt_len": prompt_len, "max_tokens": max_tokens, "steps_per_block": steps, "rounds": rounds,
              "threads": torch.get_num_threads(), **place.report()}
    for name in architectures:
        build, canvas = ARCHITECTURES[name]
        net = build(**shape.get(name, {}), device=device, dtype=place.torch_dtype)
        entry = {"parameters": sum(p.numel() for p in net.parameters()), "canvas": canvas,
                 "block_length": net.spec.block_length}
        for batch in batch_sizes:
            # the shapes every run has, and a warm-up of both sides (allocator, weights paged in)
            shapes = [length for *_, length in project_forwards(net, canvas, batch, prompt_len, max_tokens, steps,
                                                                place)]
            reference_forwards(net, canvas, batch, shapes)
            pairs = [pair for _ in range(rounds) for pair in project_forwards(
                net, canvas, batch, prompt_len, max_tokens, steps, place, paired=True)]
            ratios = statistics.quantiles([project / reference for project, reference, _ in pairs], n=4)
            entry[f"batch_{batch}"] = {
                "forwards": len(shapes), "tokens_per_row": sorted(set(shapes)),
                "project_ms_per_forward": round(1000 * statistics.median(p for p, _, _ in pairs), 2),
                "reference_ms_per_forward": round(1000 * statistics.median(r for _, r, _ in pairs), 2),
                "project_over_reference": round(ratios[1], 3),
                "project_over_reference_quartiles": [round(ratios[0], 3), round(ratios[2], 3)]}
        report[name] = entry
    return report
