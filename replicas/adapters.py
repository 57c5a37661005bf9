"""Unmerged LoRA adapters applied per row: one step runs the base model's rows and the
rows of several adapters together.

``enable_adapters(net)`` turns the linear layers an adapter may target (every attention
projection, and a dense MLP's three; not a mixture of experts' experts, which see only
the tokens routed to them) into ``AdaptedLinear``s that share one ``AdapterBank``. Before
each forward the runner tells the bank which tokens belong to which adapter
(``AdapterBank.begin``); each adapted layer then adds ``x @ A.T @ (scale * B).T`` to the
outputs of those tokens only, one pair of small products per adapter present in the step.
A step without an adapted row costs one empty loop a layer. The last decoder layer feeds
its MLP only the tokens whose logits are read (``DecoderLayer``'s ``keep``): it switches
the bank to those tokens' groups (``AdapterBank.keep``).

Which adapters stay loaded is decided by the replica (``serve.multiplexed``, least
recently used out); a request holds its ``Adapter`` until it ends, so an adapter evicted
meanwhile finishes its rows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from replicas.models.layers import SwiGLU
from replicas.models.lora import adapter_on

Group = tuple["Adapter", torch.Tensor | None]  # an adapter and its tokens' indices (None: every token)


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: ``deltas[module name] = (A [r, in], scale * B [out, r])``."""

    name: str
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.deltas.values())


class AdapterBank:
    """The adapted layers of one model and, during a forward, its tokens' adapters."""

    def __init__(self, linears: dict[str, nn.Linear]):
        self.linears = linears  # module name -> the adapted layer
        self.groups: tuple[Group, ...] = ()
        self._kept: tuple[Group, ...] = ()

    def load(self, name: str, path: str | Path, rename: Callable[[str], str]) -> Adapter:
        """The adapter at ``path``, on the model's device and dtype (raises ``LoraError``
        naming the module that does not fit)."""
        scale, pairs = adapter_on(self.linears, path, rename)
        deltas = {}
        for module, (a, b) in pairs.items():
            weight = self.linears[module].weight
            deltas[module] = (a.to(weight.device, weight.dtype),
                              (scale * b.float()).to(weight.device, weight.dtype))
        return Adapter(name, deltas)

    def begin(self, token_rows: np.ndarray, kept_tokens: np.ndarray, row_adapters: list[Adapter | None],
              device: torch.device) -> None:
        """Set the coming forward's groups: ``token_rows[t]``, the row of packed token t;
        ``kept_tokens``, the tokens the last layer's MLP keeps; ``row_adapters[row]``."""
        rows_of: dict[Adapter, list[int]] = {}
        for row in np.unique(token_rows).tolist():
            adapter = row_adapters[row]
            if adapter is not None:
                rows_of.setdefault(adapter, []).append(row)
        self.groups = _groups(token_rows, rows_of, device)
        self._kept = _groups(token_rows[kept_tokens], rows_of, device) if rows_of else ()

    def keep(self) -> None:
        """From here on the forward runs on the kept tokens only."""
        self.groups = self._kept

    def end(self) -> None:
        self.groups = self._kept = ()


def _groups(token_rows: np.ndarray, rows_of: dict[Adapter, list[int]], device: torch.device) -> tuple[Group, ...]:
    groups = []
    for adapter, rows in rows_of.items():
        tokens = np.flatnonzero(np.isin(token_rows, rows))
        if tokens.size:
            whole = tokens.size == token_rows.size
            groups.append((adapter, None if whole else torch.from_numpy(tokens).to(device)))
    return tuple(groups)


class AdaptedLinear(nn.Linear):
    """A linear layer that adds the deltas of its tokens' adapters (``AdapterBank.groups``)."""

    bank: AdapterBank
    adapted_name: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        for adapter, tokens in self.bank.groups:
            pair = adapter.deltas.get(self.adapted_name)
            if pair is None:
                continue
            a, b = pair
            if tokens is None:
                y = y + F.linear(F.linear(x, a), b)
            else:
                rows = x.reshape(-1, x.shape[-1]).index_select(0, tokens)
                y = y.reshape(-1, y.shape[-1]).index_add(0, tokens, F.linear(F.linear(rows, a), b)).view(y.shape)
        return y


def enable_adapters(net: nn.Module) -> AdapterBank:
    """Make ``net``'s adaptable linear layers ``AdaptedLinear`` (same parameters, same
    names) sharing one new bank, and give each decoder layer the bank (its ``keep``)."""
    layers = getattr(getattr(net, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(net).__name__} takes no unmerged adapters: they are served on the decoder "
                         "stack of LLaDA, Dream, SDAR and LLaDA2.0")
    if any(layer.adapters is not None for layer in layers):
        raise ValueError("this model serves adapters for another engine already: load it again for this one")
    linears: dict[str, nn.Linear] = {}
    for index, layer in enumerate(layers):
        parts = [("self_attn", layer.self_attn)] + ([("mlp", layer.mlp)] if isinstance(layer.mlp, SwiGLU) else [])
        for part_name, part in parts:
            for name, module in part.named_children():
                if type(module) is nn.Linear:
                    linears[f"model.layers.{index}.{part_name}.{name}"] = module
    bank = AdapterBank(linears)
    for name, module in linears.items():
        module.__class__ = AdaptedLinear
        module.bank = bank
        module.adapted_name = name
    for layer in layers:
        layer.adapters = bank
    return bank


class ResidentAdapters:
    """The adapters a replica serves by name (``paths``: name -> PEFT directory), at most
    ``capacity`` of them loaded, the least recently used dropped first (the requests
    holding it keep theirs). Thread-safe: the replica warms an adapter off its event loop
    before the request reaches the engine."""

    def __init__(self, bank: AdapterBank, paths: dict[str, str], capacity: int, rename: Callable[[str], str]):
        self.bank = bank
        self.paths = dict(paths)
        self.capacity = capacity
        self.rename = rename
        self._loaded: OrderedDict[str, Adapter] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> Adapter:
        """The adapter ``name``, loaded if it is not (raises KeyError for a name not served)."""
        with self._lock:
            adapter = self._loaded.get(name)
            if adapter is not None:
                self._loaded.move_to_end(name)
                return adapter
            adapter = self._loaded[name] = self.bank.load(name, self.paths[name], self.rename)
            while len(self._loaded) > self.capacity:
                self._loaded.popitem(last=False)
            return adapter

    @property
    def loaded(self) -> list[str]:
        """The names loaded now, least recently used first."""
        with self._lock:
            return list(self._loaded)
