"""Load the model a `ModelSpec` names, the Hugging Face way, on the device it asks for.

- `load_tokenizer(spec)`: `AutoTokenizer.from_pretrained`, with a pad token (the EOS token
  when the checkpoint has none: rlplex pads by hand and masks pads out, so any id will do).
- `check_tokenizer(spec)`: what `rlplex check` and `rlplex run` ask before any process starts:
  the tokenizer loads and has a pad or EOS token, in about 1 s where a folder holds its
  `tokenizer.json` (read by the fast class itself, without torch or the Auto classes' imports).
- `load_causal_lm(spec)`: `AutoModelForCausalLM.from_pretrained` in the spec's dtype, frozen,
  in eval mode, on `resolve_device(spec.device)`.
- A hub id is looked up in the local Hugging Face cache first (`local_files_only`), so a
  cached model loads with the network off; only a cache miss goes to the hub, and a miss
  that cannot be downloaded is a one-line `ModelLoadError` naming the id and what to do, never
  a raw traceback; an unreachable hub is found in seconds, not after a minute of retries.
- `encode_prompt` renders an `Example` to token ids: chat messages through the tokenizer's
  chat template (an error if it has none), raw text as is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from rlplex.errors import ModelLoadError
from rlplex.models.spec import ModelSpec
from rlplex.tasks import Example

# torch and transformers are imported where a model or tokenizer loads: about 1.5 s and 3 s of
# imports (dynamo, sympy, distributed tensors) that a process which only checks a job never needs.
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    Tokenizer: TypeAlias = PreTrainedTokenizerBase
else:
    Tokenizer = Any


def resolve_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    import torch

    if spec.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _looks_like_a_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else can only be meant as a folder.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def _from_pretrained(loader: Any, spec: ModelSpec, what: str, **kwargs: Any) -> Any:
    kwargs |= {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
    if not spec.is_local and _looks_like_a_path(spec.name):
        raise ModelLoadError(
            f"model {spec.name!r}: no such folder (a local model is a save_pretrained folder; "
            f"`rlplex model tiny {spec.name}` builds rlplex's tiny one there)"
        )
    if spec.is_local:
        try:
            return loader.from_pretrained(spec.resolved().name, **kwargs)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"model {spec.name!r}: cannot load its {what} from the folder: {error}") from None
    try:
        return loader.from_pretrained(spec.name, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        missing = f"model {spec.name!r} is not a local folder and its {what} is not in the Hugging Face cache"
        if _offline():
            raise ModelLoadError(f"{missing} (HF_HUB_OFFLINE is set, so nothing is downloaded); {_REMEDY}") from None
        if (why := _hub_unreachable()) is not None:
            raise ModelLoadError(f"{missing}, and the hub cannot be reached ({why}); {_REMEDY}") from None
    try:
        return loader.from_pretrained(spec.name, **kwargs)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())  # one line
        raise ModelLoadError(f"model {spec.name!r}: could not download its {what} from the hub: {reason}") from None


_REMEDY = (
    "name a save_pretrained folder instead (`rlplex model tiny DIR` builds one), or download the model "
    "where the hub is reachable (it then loads from the cache)"
)
_PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the hub's host refuses a TCP connection now, or None. A check of seconds where a
    download from an unreachable hub retries for about a minute; skipped behind a proxy, which
    only the download itself goes through."""
    if any(os.environ.get(name) for name in _PROXY_ENV):
        return None
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        return f"{host}:{port}: {error.strerror or error}"
    return None


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    from transformers import AutoTokenizer

    return _with_pad(_from_pretrained(AutoTokenizer, spec, "tokenizer"), spec)


def check_tokenizer(spec: ModelSpec) -> None:
    """Fail now, as `load_tokenizer` would in every process later, if the tokenizer cannot load.

    A local folder with a `tokenizer.json` is read by the fast tokenizer class the Auto class
    would pick for it (`PreTrainedTokenizerFast`): the same file, special tokens and
    tokenizer_config.json, in about 1 s against 5 s, for a check whose tokenizer nobody keeps.
    Anything else (a hub id, a slow-only tokenizer) goes through `load_tokenizer` itself."""
    if spec.local_file("tokenizer.json") is not None:
        from transformers import PreTrainedTokenizerFast

        _with_pad(_from_pretrained(PreTrainedTokenizerFast, spec, "tokenizer"), spec)
    else:
        load_tokenizer(spec)


def _with_pad(tokenizer: Tokenizer, spec: ModelSpec) -> Tokenizer:
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelLoadError(f"model {spec.name!r}: its tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(spec: ModelSpec, device: torch.device | None = None) -> PreTrainedModel:
    """The frozen base model in eval mode on `device` (default: the spec's)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rlplex.models.device import resolve_device

    device = device or resolve_device(spec.device)
    # Its per-load progress bar would fill every orchestrator's and rank's log; rlplex shows its own.
    hf_logging.disable_progress_bar()
    model: PreTrainedModel = _from_pretrained(AutoModelForCausalLM, spec, "weights", dtype=resolve_dtype(spec, device))
    moved: PreTrainedModel = model.to(device)  # type: ignore[arg-type]  # transformers' stubs miss this overload
    return moved.eval().requires_grad_(False)


def stop_token_ids(tokenizer: Tokenizer, model: torch.nn.Module | None = None) -> list[int]:
    """Ids that end a completion: the tokenizer's EOS and the model's generation EOS ids."""
    return _stop_ids(tokenizer, getattr(model, "generation_config", None))


def model_stop_ids(spec: ModelSpec, tokenizer: Tokenizer) -> list[int]:
    """`stop_token_ids` without loading the weights: the generation config is read on its own
    (a server generates; the client still needs the ids that end a completion)."""
    from transformers import GenerationConfig

    try:
        generation = _from_pretrained(GenerationConfig, spec, "generation config")
    except ModelLoadError:
        generation = None  # a checkpoint without generation_config.json: the tokenizer's EOS
    return _stop_ids(tokenizer, generation)


def _stop_ids(tokenizer: Tokenizer, generation: Any) -> list[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Sequence):
        ids.update(int(i) for i in eos)
    if not ids:
        raise ModelLoadError("the tokenizer and model name no EOS token: completions could never end")
    return sorted(ids)


def encode_prompt(tokenizer: Tokenizer, example: Example) -> list[int]:
    if example.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise ModelLoadError("the environment gives chat messages, but the model's tokenizer has no chat template")
        rendered: Any = tokenizer.apply_chat_template(list(example.messages), add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding; older releases a plain list of ids.
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(example.prompt or "", add_special_tokens=True)]


def encode_answer(tokenizer: Tokenizer, answer: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(answer, add_special_tokens=False)]


def decode_completion(tokenizer: Tokenizer, ids: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The text of a completion up to its first stop token; special tokens dropped."""
    stops = set(stop_ids)
    end = next((i for i, token in enumerate(ids) if token in stops), len(ids))
    return str(tokenizer.decode(list(ids[:end]), skip_special_tokens=True))


__all__ = [
    "Tokenizer",
    "check_tokenizer",
    "decode_completion",
    "encode_answer",
    "encode_prompt",
    "load_causal_lm",
    "load_tokenizer",
    "model_stop_ids",
    "resolve_dtype",
    "stop_token_ids",
]
