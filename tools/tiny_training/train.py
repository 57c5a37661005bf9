"""Training the tiny block-diffusion model on the Sudoku canvas task (BD3LM style).

Each training sequence is ``[prompt (7 pages), clean answer blocks 0..5, noisy answer
blocks 0..6]``. The noisy copy of block j has the positions of clean block j and attends
to the prompt pages, the clean blocks before j and itself; the prompt and the clean
blocks attend block-causally among themselves. The loss is the cross-entropy on the
masked positions of the noisy blocks, each block masked with its own ratio t in (0, 1].
This is exactly what serving computes: a block being denoised sees the cached prompt,
the committed blocks and itself.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from replicas.attention import DenseAttentionContext
from replicas.models.checkpoint import save_model
from replicas.models.tiny import TinyDllmConfig, TinyDllmForBlockDiffusion
from replicas.tiny import task
from replicas.tiny.tokenizer import BOS, EOS, MASK, PAD, save_tokenizer

L = 16
PROMPT = task.SLOTS * L  # 112 tokens, 7 pages
ANSWER_BLOCKS = task.SLOTS  # up to 6 grids and the EOS block


@dataclass
class TrainConfig:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 384
    # small batches and a high peak rate learn the most per second on two cores
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    # mask ratio t = u ** exponent with u ~ U(0, 1]: 0.5 favours heavily masked blocks,
    # the states where decoding starts and where the hard puzzles fail
    mask_ratio_exponent: float = 0.5
    # training-only sampling (held-out requests use uniform k and blank counts): more
    # puzzles per request and more hard puzzles carry more signal per forward
    k_weights: list[float] = field(default_factory=lambda: [1, 1, 1, 1, 2, 4])
    blank_weights: list[float] = field(default_factory=lambda: [1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4, 4])
    # share of the filled cells of a noisy block replaced by a random digit (edit training)
    edit_noise: float = 0.05
    eval_every_s: float = 60.0
    quick_eval_requests: int = 48


class TaskTokens:
    """Token ids of the task's characters, from the tokenizer's vocabulary."""

    def __init__(self, vocab: dict[str, int], eos: int, mask: int):
        self.digit = torch.tensor([vocab[c] for c in task.BLANK + "1234"])  # cell value 0..4 -> id
        self.empty = vocab[task.EMPTY]
        self.eos = eos
        self.mask = mask


def training_mask() -> torch.Tensor:
    """``BoolTensor[1, 1, S, S]`` for the training layout (True = may attend)."""
    context_page = torch.cat([
        torch.arange(PROMPT) // L, task.SLOTS + torch.arange((ANSWER_BLOCKS - 1) * L) // L
    ])
    noisy_block = torch.arange(ANSWER_BLOCKS * L) // L
    context_rows = torch.cat([
        context_page[:, None] >= context_page[None, :],  # block-causal
        torch.zeros(len(context_page), len(noisy_block), dtype=torch.bool),
    ], 1)
    noisy_rows = torch.cat([
        context_page[None, :] < task.SLOTS + noisy_block[:, None],  # prompt, earlier clean blocks
        noisy_block[:, None] == noisy_block[None, :],  # itself
    ], 1)
    return torch.cat([context_rows, noisy_rows], 0)[None, None]


def training_positions() -> torch.Tensor:
    """Serving positions of the training layout: each noisy block reuses its clean block's."""
    answer = PROMPT + torch.arange(ANSWER_BLOCKS * L)
    return torch.cat([torch.arange(PROMPT), answer[:-L], answer])


def sample_batch(
    tokens: TaskTokens, cfg: TrainConfig, generator: torch.Generator, puzzle_rng: np.random.Generator,
    exclude: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S], targets [B, 7*L])``: the clean answer at every noisy position.
    Puzzles come from ``puzzle_rng``, everything else from ``generator``."""
    b = cfg.batch_size
    k_weights = torch.tensor(cfg.k_weights, dtype=torch.float)
    k = 1 + torch.multinomial(k_weights, b, replacement=True, generator=generator)
    filled = torch.arange(task.SLOTS)[None] < k[:, None]  # [B, 7]
    givens, solutions = (torch.from_numpy(cells) for cells in task.sample_puzzles(
        int(filled.sum()), puzzle_rng, np.array(cfg.blank_weights), exclude))
    prompt = torch.full((b, task.SLOTS, L), tokens.empty)
    answer = torch.full((b, task.SLOTS, L), tokens.eos)
    prompt[filled] = tokens.digit[givens]
    answer[filled] = tokens.digit[solutions]
    u = 1.0 - torch.rand(b, task.SLOTS, 1, generator=generator)  # (0, 1]
    masked = torch.rand(b, task.SLOTS, L, generator=generator) < u ** cfg.mask_ratio_exponent
    # token-to-token editing (JointThreshold): some filled cells hold a wrong digit, and the
    # loss covers every position, so the model learns to keep right tokens and fix wrong ones
    wrong = ~masked & (torch.rand(b, task.SLOTS, L, generator=generator) < cfg.edit_noise)
    random_digits = tokens.digit[1 + torch.randint(0, 4, (b, task.SLOTS, L), generator=generator)]
    noisy = torch.where(wrong, random_digits, answer.masked_fill(masked, tokens.mask))
    input_ids = torch.cat([prompt.flatten(1), answer[:, :-1].flatten(1), noisy.flatten(1)], 1)
    return input_ids, answer.flatten(1)


class _MonitorContext:
    """Attention for the monitor decoder: new tokens see a cached prefix and themselves
    (under ``mask`` when given); the new keys and values are kept for the cache."""

    def __init__(self, prefix_k: list[torch.Tensor] | None, prefix_v: list[torch.Tensor] | None,
                 mask: torch.Tensor | None = None):
        self.prefix_k, self.prefix_v, self.mask = prefix_k, prefix_v, mask
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer], self.v[layer] = k, v
        if self.prefix_k is not None:
            k = torch.cat([self.prefix_k[layer], k], 1)
            v = torch.cat([self.prefix_v[layer], v], 1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask
        )
        return out.transpose(1, 2)


@torch.no_grad()
def monitor_decode(net: TinyDllmForBlockDiffusion, prompt_ids: torch.Tensor, tokens: TaskTokens,
                   threshold: float = 0.95) -> tuple[list[list[int]], list[int]]:
    """Training-time monitor: greedy LowConfidence decoding of ``prompt_ids [N, 112]``.

    Mirrors serving: the prompt and each committed block are cached with the KV of the
    forward that saw them final; every denoise step fills the masked positions whose
    probability exceeds ``threshold`` (at least the most confident one), and a block is
    committed when a forward sees no mask. Stops a row after its first block holding EOS.
    Returns the generated ids per row (up to its first EOS) and the step count of every
    generated block (forwards, including the final one that sees no mask).
    """
    n, layers = len(prompt_ids), net.config.num_hidden_layers
    page = torch.arange(PROMPT) // L
    ctx = _MonitorContext(None, None, (page[:, None] >= page[None, :])[None, None])
    net(prompt_ids, torch.arange(PROMPT).expand(n, -1), ctx)
    cache_k = [ctx.k[i] for i in range(layers)]
    cache_v = [ctx.v[i] for i in range(layers)]
    live = torch.ones(n, dtype=torch.bool)
    generated = torch.full((n, ANSWER_BLOCKS, L), tokens.eos)
    block_steps: list[int] = []
    for j in range(ANSWER_BLOCKS):
        rows = live.nonzero().squeeze(1)
        if not len(rows):
            break
        block = torch.full((len(rows), L), tokens.mask)
        done = torch.zeros(len(rows), dtype=torch.bool)
        steps = torch.zeros(len(rows), dtype=torch.long)
        final_k = [cache_k[0].new_zeros(n, L, *cache_k[0].shape[2:]) for _ in range(layers)]
        final_v = [cache_v[0].new_zeros(n, L, *cache_v[0].shape[2:]) for _ in range(layers)]
        positions = PROMPT + j * L + torch.arange(L)
        while not done.all():
            act = (~done).nonzero().squeeze(1)
            idx = rows[act]
            ctx = _MonitorContext([c[idx] for c in cache_k], [c[idx] for c in cache_v])
            logits = net(block[act], positions.expand(len(act), -1), ctx)
            steps[act] += 1
            for i in range(layers):
                final_k[i][idx], final_v[i][idx] = ctx.k[i], ctx.v[i]
            current = block[act]
            masked = current == tokens.mask
            done[act] = ~masked.any(-1)
            conf, pred = logits.softmax(-1).max(-1)
            conf = conf.masked_fill(~masked, -1.0)
            fill = masked & (conf > threshold)
            fill[torch.arange(len(act)), conf.argmax(-1)] |= masked.any(-1)
            block[act] = torch.where(fill, pred, current)
        cache_k = [torch.cat([c, f], 1) for c, f in zip(cache_k, final_k)]
        cache_v = [torch.cat([c, f], 1) for c, f in zip(cache_v, final_v)]
        generated[rows, j] = block
        block_steps += steps.tolist()
        live[rows] = ~(block == tokens.eos).any(-1)
    outputs = []
    for row in generated.flatten(1).tolist():
        outputs.append(row[: row.index(tokens.eos)] if tokens.eos in row else row)
    return outputs, block_steps


def evaluate(net, tokenizer, tokens: TaskTokens, requests, chunk: int = 100) -> dict:
    """Held-out accuracy (per request, per puzzle) and the steps-per-block histogram."""
    solved_requests = solved_puzzles = puzzles = 0
    histogram: Counter[int] = Counter()
    for start in range(0, len(requests), chunk):
        part = requests[start:start + chunk]
        prompt_ids = torch.tensor([tokenizer.encode(r.prompt).ids for r in part])
        outputs, steps = monitor_decode(net, prompt_ids, tokens)
        histogram.update(steps)
        for request, ids in zip(part, outputs):
            correct = task.grade(request, tokenizer.decode(ids))
            solved_requests += all(correct)
            solved_puzzles += sum(correct)
            puzzles += len(correct)
    return {
        "request_accuracy": solved_requests / len(requests),
        "puzzle_accuracy": solved_puzzles / puzzles,
        "steps_histogram": dict(sorted(histogram.items())),
    }


def train_tiny(
    output_dir: str | Path,
    max_minutes: float = 7.0,
    seed: int = 0,
    log: Callable[[str], None] = print,
    final_eval: bool = True,
    config: TrainConfig | None = None,
    max_steps: int | None = None,
    threads: int = 2,
) -> dict:
    """Train for ``max_minutes`` of wall clock (or ``max_steps`` optimizer steps, whichever
    comes first; the learning-rate schedule follows the nearer one), then write the
    checkpoint into ``output_dir``.

    Logs the loss and a quick held-out accuracy every ``eval_every_s``; with
    ``final_eval`` the whole held-out set is decoded at the end (outside the budget).
    Returns the final metrics.
    """
    cfg = config or TrainConfig()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    puzzle_rng = np.random.default_rng(seed)
    output_dir = Path(output_dir)
    tokenizer = save_tokenizer(output_dir)
    vocab = tokenizer.get_vocab()
    tokens = TaskTokens(vocab, vocab[EOS], vocab[MASK])
    net = TinyDllmForBlockDiffusion(TinyDllmConfig(
        vocab_size=tokenizer.get_vocab_size(), mask_token_id=vocab[MASK], eos_token_id=vocab[EOS],
        pad_token_id=vocab[PAD], bos_token_id=vocab[BOS], hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size, block_length=L,
    ))
    log(f"tiny model: {sum(p.numel() for p in net.parameters()):,} parameters")
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                                  weight_decay=cfg.weight_decay)
    mask, positions = training_mask(), training_positions()
    exclude = task.heldout_keys()
    heldout = task.heldout_requests()
    budget = max_minutes * 60.0
    start = last_eval = time.monotonic()
    step, running = 0, None
    while (elapsed := time.monotonic() - start) < budget and step != max_steps:
        progress = max(elapsed / budget, step / max_steps if max_steps else 0.0)
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr
        input_ids, targets = sample_batch(tokens, cfg, generator, puzzle_rng, exclude)
        net.train()
        logits = net(input_ids, positions.expand(len(input_ids), -1), DenseAttentionContext(mask))
        loss = F.cross_entropy(logits[:, -targets.shape[1]:].flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        step += 1
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if time.monotonic() - last_eval >= cfg.eval_every_s:
            net.eval()
            quick = evaluate(net, tokenizer, tokens, heldout[: cfg.quick_eval_requests])
            log(f"step {step} {elapsed:.0f}s loss {running:.4f} lr {lr:.2e} "
                f"quick held-out: request {quick['request_accuracy']:.3f} "
                f"puzzle {quick['puzzle_accuracy']:.3f}")
            last_eval = time.monotonic()
    net.eval()
    save_model(net, output_dir)
    metrics = {"steps": step, "train_seconds": time.monotonic() - start, "loss": running}
    log(f"trained {step} steps in {metrics['train_seconds']:.0f}s, loss {running:.4f}; saved to {output_dir}")
    if final_eval:
        metrics.update(evaluate(net, tokenizer, tokens, heldout))
        log(f"held-out ({len(heldout)} requests): request accuracy {metrics['request_accuracy']:.3f}, "
            f"puzzle accuracy {metrics['puzzle_accuracy']:.3f}, steps per block {metrics['steps_histogram']}")
    return metrics


if __name__ == "__main__":
    import sys

    train_tiny(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "checkpoint")
