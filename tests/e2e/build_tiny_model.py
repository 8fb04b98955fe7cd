"""Build the tiny random Llama model that the end-to-end tests serve with real vLLM on CPU.

Run it with the vLLM venv's interpreter (it needs torch and transformers):

    ~/.cache/hetgate/vllm-venv/bin/python tests/e2e/build_tiny_model.py [--out DIR] [--force]

Nothing is downloaded: the byte-level BPE tokenizer is trained on this interpreter's own standard
library sources, the weights are random with a fixed seed. The model is cached in DIR (default
``$HETGATE_TINY_MODEL`` or ``~/.cache/hetgate/tiny-model``) and rebuilt only when the folder is
missing or incomplete: a stamp file, written last, holds the recipe, so an interrupted build or a
changed recipe triggers a rebuild. The build happens in a temporary sibling folder that is renamed
into place, so concurrent builders never see half a model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
VOCAB_SIZE = 4096
TRAINING_FILES = 171
SEED = 1234
STAMP_NAME = ".hetgate-tiny-model.json"

# ChatML, as Qwen-style models use it; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MODEL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}

# Any change here changes the stamp and forces a rebuild of cached models.
RECIPE = {
    "version": 1,
    "vocab_size": VOCAB_SIZE,
    "special_tokens": SPECIAL_TOKENS,
    "training_files": TRAINING_FILES,
    "seed": SEED,
    "chat_template": CHAT_TEMPLATE,
    "shape": MODEL_SHAPE,
}
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def default_model_dir() -> Path:
    configured = os.environ.get("HETGATE_TINY_MODEL")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "hetgate" / "tiny-model"


def is_complete(model_dir: Path) -> bool:
    """True when every file is present and the stamp matches today's recipe."""
    stamp = model_dir / STAMP_NAME
    if not stamp.is_file() or any(not (model_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return json.loads(stamp.read_text()) == RECIPE
    except ValueError:
        return False


def training_texts() -> list[str]:
    """The first stdlib modules by name: the same text on every machine with this Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:TRAINING_FILES]
    return [path.read_text(encoding="utf-8", errors="replace") for path in files]


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(), trainer=trainer)
    return tokenizer


def save_tokenizer(raw_tokenizer, out: Path):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    # Older readers look for the template inside tokenizer_config.json, newer ones in the .jinja file.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tokenizer


def save_model(tokenizer, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        tie_word_embeddings=False,
        dtype="bfloat16",
        **MODEL_SHAPE,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)


def build(model_dir: Path) -> None:
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    staging.chmod(0o755)
    try:
        tokenizer = save_tokenizer(train_tokenizer(), staging)
        save_model(tokenizer, staging)
        (staging / STAMP_NAME).write_text(json.dumps(RECIPE))
        if not is_complete(staging):
            raise RuntimeError(f"build produced an incomplete model in {staging}")
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_model_dir())
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache is complete")
    args = parser.parse_args(argv)
    # Set before transformers is imported (in build): it must never reach for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.force or not is_complete(args.out):
        build(args.out)
        print(f"built tiny model in {args.out}", file=sys.stderr)
    else:
        print(f"tiny model ready in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
