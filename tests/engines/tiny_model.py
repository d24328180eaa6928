"""A tiny dummy-weight Mixtral-shaped MoE for real vLLM servers, made on the spot.

``make_model(dir)`` writes ``config.json`` (MixtralForCausalLM: 2 layers, 4 experts, top
2), a byte-level BPE tokenizer trained locally with ``tokenizers`` on generated text
(vocabulary below the model's ``vocab_size``), and a ``tokenizer_config.json`` with a
chat template. vLLM loads it with ``--load-format dummy``: nothing comes from a hub.
Run in the vLLM venv or ours (only ``tokenizers`` is needed).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 2048
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
    "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
    "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu",
]


def _config() -> dict[str, object]:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": None,
    }


def make_model(out: Path) -> Path:
    """Write the model directory (idempotent); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    if (out / "tokenizer.json").exists():
        return out
    rng = random.Random(7)
    corpus = [" ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(50))
              for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 64,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(_config(), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 8192, "chat_template": CHAT_TEMPLATE,
    }))
    return out


if __name__ == "__main__":
    print(make_model(Path(sys.argv[1])))
