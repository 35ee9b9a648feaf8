"""Multi-run: one trainer, many runs (MultiRunManager, MultiLoRALinear, per-run adapters)."""

# -- MultiLoRA (lora.py, peft_export.py) --
from rlplex.multirun.lora import AdapterBatch, MultiLoRALinear, MultiLoRAModules, apply_multi_lora
from rlplex.multirun.peft_export import write_peft_adapter

__all__ = ["AdapterBatch", "MultiLoRALinear", "MultiLoRAModules", "apply_multi_lora", "write_peft_adapter"]
