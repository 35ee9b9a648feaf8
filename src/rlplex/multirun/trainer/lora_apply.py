"""Putting `MultiLoRALinear` into a model: which layers an architecture adapts by default
(peft's choices), `apply_multi_lora` (freeze the model, wrap the targets) and
`MultiLoRAModules`, the model-wide handle the trainer and the orchestrators use."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from rlplex.errors import AdapterError
from rlplex.multirun.trainer.lora import (
    AdapterBatch,
    LocalRegistry,
    LoRARegistry,
    MultiLoRALinear,
    layer_features,
)

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGET_MODULES = ("c_attn", "c_proj", "c_fc")
# config.model_type values whose decoder layers are q/k/v/o_proj + gate/up/down_proj nn.Linear
# (checked on transformers 5.19). MoE models (mixtral, qwen*_moe) keep their experts in fused
# parameters, not Linear layers, so they fall through to the all-linear rule.
LLAMA_LIKE_MODEL_TYPES = frozenset(
    {
        "cohere",
        "ernie4_5",
        "exaone4",
        "gemma",
        "gemma2",
        "gemma3_text",
        "granite",
        "helium",
        "hunyuan_v1_dense",
        "llama",
        "ministral",
        "mistral",
        "olmo",
        "olmo2",
        "olmo3",
        "qwen2",
        "qwen3",
        "seed_oss",
        "smollm3",
        "stablelm",
    }
)
# Output heads the all-linear rule leaves out besides get_output_embeddings(): a LoRA there would
# adapt the vocabulary projection or a task head, which peft leaves out of "all-linear" too.
OUTPUT_HEAD_NAMES = frozenset({"lm_head", "embed_out", "score", "classifier"})


def _last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _adaptable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's nn.Linear and Conv1D layers by module name, leaving out those already wrapped."""
    wrapped = {id(m.base_layer) for m in model.modules() if isinstance(m, MultiLoRALinear)}
    return [
        (name, module)
        for name, module in model.named_modules()
        if id(module) not in wrapped and layer_features(module) is not None
    ]


def default_target_modules(model: nn.Module) -> tuple[str, ...]:
    """The LoRA targets of ``model``'s architecture family, as last name components (peft's matching).

    - Llama-style decoders (``config.model_type`` in ``LLAMA_LIKE_MODEL_TYPES``: llama, mistral,
      qwen2, qwen3, gemma, ...): ``DEFAULT_TARGET_MODULES``, q/k/v/o_proj and gate/up/down_proj.
    - GPT-2 (``gpt2``): c_attn, c_proj, c_fc, its Conv1D layers.
    - Any other model: every nn.Linear and Conv1D name (peft's "all-linear") except the output
      head, i.e. the module ``get_output_embeddings()`` returns and layers named as in
      ``OUTPUT_HEAD_NAMES``; a name the head shares with inner layers is left out, so those
      inner layers must be asked for by ``target_modules``.

    Raises AdapterError when the model has no such layer.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "gpt2":
        return GPT2_TARGET_MODULES
    if model_type in LLAMA_LIKE_MODEL_TYPES:
        return DEFAULT_TARGET_MODULES
    layers = _adaptable_layers(model)
    excluded = set(OUTPUT_HEAD_NAMES)
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if callable(get_output_embeddings) else None
    excluded.update(_last(name) for name, module in layers if module is head)
    names = sorted({_last(name) for name, _ in layers} - excluded)
    if not names:
        raise AdapterError(
            f"{type(model).__name__} (model_type {model_type!r}) has no nn.Linear or Conv1D layer besides its "
            "output head to put LoRA on; pass target_modules"
        )
    return tuple(names)


class MultiLoRAModules:
    """The MultiLoRALinear modules that ``apply_multi_lora`` put into a model, by module name."""

    def __init__(self, modules: dict[str, MultiLoRALinear], registry: LoRARegistry | LocalRegistry) -> None:
        self.modules = modules
        self.registry = registry

    @property
    def adapter_batch(self) -> AdapterBatch:
        return self.registry.adapter_batch

    @property
    def scaling_factors(self) -> Tensor:
        """Shared by every module: write ``scaling_factors[k] = alpha_k / rank_k`` once for all."""
        return self.registry.scaling_factors

    @property
    def lora_ranks(self) -> Tensor:
        return self.registry.lora_ranks

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The last name components of the wrapped layers, sorted: the PEFT config's target_modules."""
        return tuple(sorted({_last(name) for name in self.modules}))

    @property
    def fan_in_fan_out(self) -> bool:
        """Whether a wrapped layer is a Conv1D (GPT-2): pass it to ``write_peft_adapter`` so peft agrees."""
        return any(module.fan_in_fan_out for module in self.modules.values())

    def active_adapters(self, ids: Tensor) -> AbstractContextManager[None]:
        return self.adapter_batch.active(ids)

    def named_parameters_for_adapter(self, idx: int) -> Iterator[tuple[str, nn.Parameter]]:
        for name, module in self.modules.items():
            for local, param in module.named_parameters_for_adapter(idx):
                yield f"{name}.{local}", param

    def adapter_state_dict(self, idx: int) -> dict[str, Tensor]:
        """Keys are the model's module names plus ``.lora_A.weight`` / ``.lora_B.weight``."""
        return {
            f"{name}.{local}": tensor
            for name, module in self.modules.items()
            for local, tensor in module.adapter_state_dict(idx).items()
        }

    def reset_adapter(self, idx: int) -> None:
        for module in self.modules.values():
            module.reset_adapter(idx)

    def set_grouped_mm(self, enabled: bool | None) -> None:
        """Force the grouped-matmul path on (True) or off (False) in every module; None = automatic."""
        for module in self.modules.values():
            module.use_grouped_mm = enabled


def apply_multi_lora(
    model: nn.Module,
    target_modules: Sequence[str] | None = None,
    rank: int = 8,
    n_adapters: int | None = None,
    alpha: float = 16.0,
    dropout: float = 0.0,
    manager: LoRARegistry | None = None,
    lora_dtype: torch.dtype | None = None,
) -> MultiLoRAModules:
    """Freeze ``model`` and replace each nn.Linear or Conv1D whose name ends in a target with a MultiLoRALinear.

    Names match as in peft: the last component equals a target (``q_proj`` matches
    ``model.layers.0.self_attn.q_proj``). ``target_modules=None`` takes the architecture's
    default (``default_target_modules``). Every target must match at least one layer, else
    AdapterError lists the layer names the model has. With a manager, ``n_adapters`` defaults to
    its slot count and every module registers under its module name. ``lora_dtype``: dtype of
    the LoRA weights (default: each base layer's).
    """
    if n_adapters is None:
        if manager is None:
            raise AdapterError("apply_multi_lora: give n_adapters or a manager")
        n_adapters = int(manager.scaling_factors.shape[0])
    if isinstance(target_modules, str):
        raise AdapterError(f"apply_multi_lora: target_modules={target_modules!r} must be a list of names, not a str")
    targets = tuple(dict.fromkeys(default_target_modules(model) if target_modules is None else target_modules))
    if not targets:
        raise AdapterError("apply_multi_lora: target_modules is empty")
    layers = _adaptable_layers(model)
    found = [(name, module) for name, module in layers if _last(name) in targets]
    matched = {_last(name) for name, _ in found}
    unmatched = [target for target in targets if target not in matched]
    if unmatched:
        available = sorted({_last(name) for name, _ in layers})
        raise AdapterError(
            f"apply_multi_lora: target_modules {unmatched} match no nn.Linear or Conv1D layer of "
            f"{type(model).__name__}; its layers are named {available}"
        )
    model.requires_grad_(False)
    # Without a manager the modules share one local registry, so ranks, scalings and ids are set once.
    registry: LoRARegistry | LocalRegistry = manager or LocalRegistry(n_adapters, rank, alpha)
    modules: dict[str, MultiLoRALinear] = {}
    for name, base in found:
        lora = MultiLoRALinear(
            base, rank=rank, n_adapters=n_adapters, alpha=alpha, dropout=dropout, lora_dtype=lora_dtype
        )
        if manager is not None:
            lora.register_with_runs(manager, name)
        else:
            lora._registry = registry
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, lora)
        modules[name] = lora
    return MultiLoRAModules(modules, registry)
