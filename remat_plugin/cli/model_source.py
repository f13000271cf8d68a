"""What ``remat plan MODEL`` can name: a preset, an HF config JSON, or a ``module:factory`` import path.

- a preset: the name of a file in ``remat_plugin/cli/presets/`` (``gpt2``, ``llama``, ``bert``,
  ``gpt2-medium``), tiny sizes unless the name says otherwise;
- a path to an HF config JSON (``model_type`` and, optionally, ``architectures``);
- ``package.module:factory``: ``factory(batch_size=, seq_len=)`` returns ``(module, args, kwargs)``.

HF models are built from their config (never downloaded) on the requested device, ``meta``
included, and fed token ids (and labels, so the loss is part of the step).
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat_plugin.errors import RematError
from remat_plugin.runtime.hf_cache import disable_hf_cache

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
FORMS = "a preset (" + "{presets}" + "), a path to an HF config .json, or module:factory"


class ModelSpecError(RematError, ValueError):
    """MODEL names nothing we can build."""


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def _forms() -> str:
    return FORMS.format(presets=", ".join(presets()) or "none installed")


def _hf_config(spec: str) -> dict[str, Any]:
    path = Path(spec)
    if spec.endswith(".json"):
        if not path.is_file():
            raise ModelSpecError(f"remat: model config {spec!r} does not exist; give {_forms()}")
    else:
        path = PRESETS_DIR / f"{spec}.json"
        if not path.is_file():
            raise ModelSpecError(f"remat: unknown model preset {spec!r}; give {_forms()}")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelSpecError(f"remat: {path} is not valid JSON ({exc}); give {_forms()}") from None
    if "model_type" not in data:
        raise ModelSpecError(f"remat: {path} has no 'model_type'; an HF config JSON names its model type")
    return data


def _build_hf(data: dict[str, Any], device: torch.device) -> nn.Module:
    import transformers

    data = dict(data)
    architectures = data.pop("architectures", None) or []
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM
    with torch.device(device):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    return model.train()  # type: ignore[union-attr]


def hf_inputs(model: nn.Module, batch_size: int, seq_len: int, device: torch.device) -> tuple[tuple, dict]:
    """Token ids and labels for a language model of ``model``'s vocabulary."""
    vocab = getattr(model.config, "vocab_size", 2)
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ModelSpecError(f"remat: --seq-len {seq_len} exceeds the model's {limit} positions; lower --seq-len")
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    return (), {"input_ids": ids, "labels": ids}


def load_model(spec: str, batch_size: int, seq_len: int, device: torch.device) -> tuple[nn.Module, tuple, dict]:
    """The module named by ``spec`` on ``device`` with inputs of ``batch_size`` x ``seq_len``, any transformers model
    in it with its key/value cache off (a hub config has it on; a training step has no use for it, and export cannot
    capture it)."""
    module, args, kwargs = _load(spec, batch_size, seq_len, device)
    disable_hf_cache(module)
    return module, args, kwargs


def _load(spec: str, batch_size: int, seq_len: int, device: torch.device) -> tuple[nn.Module, tuple, dict]:
    if ":" in spec and not spec.endswith(".json"):
        module_name, _, factory_name = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), factory_name)
        except (ImportError, AttributeError) as exc:
            raise ModelSpecError(f"remat: cannot import {spec!r} ({exc}); give {_forms()}") from None
        with torch.device(device):
            made = factory(batch_size=batch_size, seq_len=seq_len)
        if not (isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module)):
            raise ModelSpecError(f"remat: {spec} must return (module, args, kwargs), not {type(made).__name__}")
        module, args, kwargs = made
        return module.train(), tuple(args), dict(kwargs)
    model = _build_hf(_hf_config(spec), device)
    args, kwargs = hf_inputs(model, batch_size, seq_len, device)
    return model, args, kwargs
