"""`dllm-serve train-tiny`: train the embedded tiny model."""

from __future__ import annotations


def add_train_tiny_parser(commands) -> None:
    train = commands.add_parser("train-tiny", help="train the embedded tiny model (<= 10 min on 2 CPU cores)")
    train.add_argument("--output", required=True, help="directory to write the checkpoint to")
    train.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget (default 8)")
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=cmd_train_tiny)


def cmd_train_tiny(args) -> int:
    from tools.tiny_training.train import train_tiny

    train_tiny(args.output, max_minutes=args.minutes, seed=args.seed)
    return 0
