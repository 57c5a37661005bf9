"""`dllm-serve bench detokenize`: what streaming text costs per block, early and late in a
long answer, with the incremental detokenizer (``replicas.detokenizer``) and with decoding
the whole output again at every block (what the engine did before), side by side.

The tokenizer is a byte-level BPE (the GPT-2 / Qwen kind that LLaDA, Dream and SDAR use)
trained here on mixed scripts, so that its tokens split characters' bytes, unless
``--tokenizer DIR`` names a local checkpoint's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

MIXED_SCRIPTS = ["Hello, world! It's a test .", "ünïcödé text, don't split ; ok ?", "数字 12 345 和 空格 的 文本",
                 "日本語のテキストです。", "emoji 🙂🎉👍🏽 and € £ ¥", "שלום עולם مرحبا بالعالم", "e\u0301 a\u0308 n\u0303"]


def byte_level_bpe(clean_up: bool = False, vocab_size: int = 400):
    """A small byte-level BPE with ``<|endoftext|>`` and ``<|mask|>``, trained on ``MIXED_SCRIPTS``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(MIXED_SCRIPTS * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|mask|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|endoftext|>", mask_token="<|mask|>",
                                   clean_up_tokenization_spaces=clean_up)


def _incremental(decode: Callable, ids: Sequence[int], block: int) -> None:
    from replicas.detokenizer import Detokenizer

    detokenizer = Detokenizer(decode, ("<stop>",))
    for before in range(0, len(ids), block):
        detokenizer.feed(ids[:before + block], before, final=before + block >= len(ids))


def _whole_again(decode: Callable, ids: Sequence[int], block: int) -> None:
    text = ""
    for before in range(0, len(ids), block):
        whole = decode(ids[:before + block])
        text, _ = whole, whole[len(text):]


def bench_detokenize(lengths: Sequence[int] = (256, 4096), block: int = 32, rounds: int = 5,
                     tokenizer_dir: str | None = None) -> dict:
    from replicas.commits import text_decoder

    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    else:
        tokenizer = byte_level_bpe()
    decode = text_decoder(tokenizer)
    text = " ".join(MIXED_SCRIPTS)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (max(lengths) // len(ids) + 1))[:max(lengths)]
    rows = {}
    for name, run in (("incremental", _incremental), ("whole_again", _whole_again)):
        per_block = {}
        for length in lengths:
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                run(decode, ids[:length], block)
                times.append((time.perf_counter() - start) / -(-length // block))
            per_block[length] = statistics.median(times)
        rows[name] = {"us_per_block": {str(k): round(v * 1e6, 2) for k, v in per_block.items()},
                      "longest_over_shortest": round(per_block[max(lengths)] / per_block[min(lengths)], 2)}
    return {"tokenizer": tokenizer_dir or "byte-level BPE trained on mixed scripts", "block": block,
            "rounds": rounds, **rows}


def add_bench_detokenize_parser(targets) -> None:
    parser = targets.add_parser(
        "detokenize", help="streamed text's cost per block at two answer lengths, incremental vs decoding it all",
        description=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dllm-serve bench detokenize --lengths 256,4096")
    parser.add_argument("--lengths", default="256,4096", metavar="N1,N2",
                        help="answer lengths in tokens (default 256,4096)")
    parser.add_argument("--block", type=int, default=32, help="tokens per block (default 32)")
    parser.add_argument("--rounds", type=int, default=5, help="runs per length; the median counts (default 5)")
    parser.add_argument("--tokenizer", metavar="DIR", help="a local checkpoint's tokenizer instead")
    parser.add_argument("--json", action="store_true", help="one JSON object on one line")
    parser.set_defaults(func=run_bench_detokenize)


def run_bench_detokenize(args) -> int:
    try:
        lengths = sorted({int(n) for n in args.lengths.split(",")})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1 or args.block < 1 or args.rounds < 1:
        raise SystemExit("dllm-serve bench detokenize: error: --lengths takes positive integers (e.g. 256,4096); "
                         "--block and --rounds must be positive")
    result = bench_detokenize(lengths, args.block, args.rounds, args.tokenizer)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
