"""The small model that tests and the demo train: a real Hugging Face checkpoint built here.

`build_tiny_model(out_dir, TinyModelConfig(...))` writes, with nothing downloaded:

- a byte-level BPE tokenizer trained on the spot with `tokenizers` on text of every built-in
  environment (`tokenizer.json`, special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``,
  ``<|im_end|>`` (EOS) and a ChatML chat template, as Qwen2 checkpoints have);
- a Qwen3-architecture model from a config (heads of 32), after a short supervised warm-up on the chosen
  environments so that RL starts from a policy with some signal;
- `save_pretrained` (safetensors) and ``rlplex_tiny.json`` (the settings and their key).

Letters and digits are split into single characters before BPE (as Llama and Qwen split
digits): the toy tasks are character puzzles, and a 2-layer model learns them in a minute
only when each character is one token. Merges still form on everything else.

The folder is cached by its settings (`rlplex.models.cache.build_cached`): a second call with
the same settings returns at once; a folder built with other settings is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from rlplex.config import StrictModel
from rlplex.models.cache import build_cached, read_settings
from rlplex.tasks import Environment, EnvSpec, Example, load_environment

SETTINGS_FILE = "rlplex_tiny.json"
_FORMAT_VERSION = 2  # bump when the same settings would build a different model
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TOKENIZER_ENVS = ("reverse", "sort_digits", "add", "arithmetic")


class TinyModelConfig(StrictModel):
    tasks: tuple[str | EnvSpec, ...] = Field(
        ("reverse",), min_length=1, description="Environments of the warm-up: names, or specs with settings."
    )
    vocab_size: int = Field(320, ge=260, le=65536, description="BPE vocabulary: 256 bytes, 3 specials, merges.")
    hidden_size: int = Field(64, ge=8)
    intermediate_size: int = Field(192, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    head_dim: int = Field(32, ge=8, description="Size of an attention head; vLLM's CPU kernels take 32 and up.")
    max_len: int = Field(128, ge=16, description="Longest prompt + completion, in tokens.")
    seed: int = 0
    warmup_steps: int = Field(120, ge=0, description="Supervised steps, so RL starts with a signal.")
    warmup_batch_size: int = Field(64, ge=1)
    warmup_lr: float = Field(3e-3, gt=0)

    def key(self) -> str:
        payload = {"format": _FORMAT_VERSION, **self.model_dump(mode="json")}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _render(example: Example) -> str:
    if example.messages is None:
        return f"{example.prompt}{example.answer}{IM_END}"
    turns = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in example.messages)
    return f"{turns}{IM_START}assistant\n{example.answer}{IM_END}\n"


def train_tokenizer(vocab_size: int, seed: int = 0, texts_per_env: int = 400) -> object:
    """A byte-level BPE `PreTrainedTokenizerFast` trained on the built-in environments' text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(seed)
    corpus = [_render(e) for name in _TOKENIZER_ENVS for e in load_environment(name).sample(texts_per_env, rng)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[A-Za-z0-9]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=IM_END, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build(out: Path, config: TinyModelConfig, on_step: Callable[[int, float], None] | None) -> None:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from rlplex.models.lm import supervised_warmup

    environments: list[Environment] = [load_environment(name) for name in config.tasks]
    tokenizer = train_tokenizer(config.vocab_size, config.seed)
    vocab = len(tokenizer)  # type: ignore[arg-type]
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id  # type: ignore[attr-defined]
    torch.manual_seed(config.seed)
    # Qwen3: the Qwen family whose head size is its own setting (in transformers and vLLM alike), so
    # heads of 32 (what vLLM's CPU attention takes) fit a hidden size of 64.
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_len,
            pad_token_id=pad_id,
            bos_token_id=None,
            eos_token_id=eos_id,
            tie_word_embeddings=True,
        )
    )
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    if config.warmup_steps:
        supervised_warmup(
            model,
            tokenizer,  # type: ignore[arg-type]
            environments,
            steps=config.warmup_steps,
            batch_size=config.warmup_batch_size,
            lr=config.warmup_lr,
            seed=config.seed,
            on_step=on_step,
        )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would interleave with rlplex's own
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]


def read_tiny_settings(out_dir: Path) -> dict[str, object] | None:
    return read_settings(out_dir, SETTINGS_FILE)


def build_tiny_model(
    out_dir: str | Path,
    config: TinyModelConfig | None = None,
    on_step: Callable[[int, float], None] | None = None,
    replace: bool = False,
) -> Path:
    """Build (or find, cached) the tiny checkpoint in `out_dir`; returns its absolute path.

    `replace`: a tiny model of other settings there (an older rlplex's, say) is rebuilt; a
    folder that is not a tiny model is never touched."""
    config = config or TinyModelConfig()
    return build_cached(
        out_dir,
        SETTINGS_FILE,
        config.key(),
        config.model_dump(mode="json"),
        lambda tmp: _build(tmp, config, on_step),
        replace=replace,
        what="tiny model",
    )


__all__ = [
    "CHAT_TEMPLATE",
    "TinyModelConfig",
    "build_tiny_model",
    "read_tiny_settings",
    "train_tokenizer",
]
