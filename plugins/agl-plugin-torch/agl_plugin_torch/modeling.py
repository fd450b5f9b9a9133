"""The policy's model and tokenizer: loaded from a local directory, or made from a config with a word tokenizer.

A made model is written to ``<run_dir>/model`` (config, initial weights,
tokenizer with its chat template) before training, so the run can be
reloaded with ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` without this plugin. Nothing here reaches
the network: every load is ``local_files_only``.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel,
                          PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config)

from agl_plugin_torch.settings import BuildConfig, ModelConfig

PAD, UNK, END = "<pad>", "<unk>", "<|end|>"
ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = (PAD, UNK, END, *(f"<|{role}|>" for role in ROLES))

# Each message is "<|role|> content <|end|>"; the model's turn starts after "<|assistant|>" and
# ends with the "<|end|>" it generates, so a reply re-rendered in the next prompt is the same ids.
# Tools, when a request offers them, come first as "<|system|> tools : name ( param ... ) <|end|>";
# an assistant's tool calls follow its content in the pythonic format (agl_core.gateway.tool_calls), which
# a word tokenizer splits the same way whether the model wrote them or the template did.
CHAT_TEMPLATE = ("{% if tools %}<|system|> tools :{% for tool in tools %} {{ tool['function']['name'] }} ("
                 "{% for name in (tool['function'].get('parameters') or {}).get('properties', {}) %} {{ name }}"
                 "{% endfor %} ){% endfor %} <|end|> {% endif %}"
                 "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }}"
                 "{% if message.get('tool_calls') %}[{% for call in message['tool_calls'] %}"
                 "{% if not loop.first %}, {% endif %}{{ call['function']['name'] }}("
                 "{% for key, value in call['function']['arguments'].items() %}{% if not loop.first %}, {% endif %}"
                 "{{ key }}={{ value | tojson }}{% endfor %}){% endfor %}]{% endif %} <|end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def word_tokenizer(vocabulary: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer whose tokens are the given words plus the special tokens, with a chat template.

    Text is split on whitespace and punctuation; a piece that is not a word
    of the vocabulary becomes ``<unk>``. Decoding joins tokens with spaces.
    """
    words = list(dict.fromkeys(w for w in vocabulary if w not in SPECIAL_TOKENS))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=END,
                                        additional_special_tokens=[f"<|{role}|>" for role in ROLES])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(build: BuildConfig, tokenizer: PreTrainedTokenizerBase):
    """The transformers config of a made model (tied embeddings, no dropout)."""
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[build.architecture]
    return cls(vocab_size=max(len(tokenizer), build.vocab_size or 0), hidden_size=build.hidden_size,
               num_hidden_layers=build.num_layers, num_attention_heads=build.num_heads,
               num_key_value_heads=build.num_kv_heads or build.num_heads,
               intermediate_size=build.intermediate_size or 4 * build.hidden_size,
               max_position_embeddings=build.max_position_embeddings, initializer_range=build.init_std,
               tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=None)


def device_and_dtype(config: ModelConfig) -> tuple[torch.device, torch.dtype]:
    """The device and weights dtype the recipe asks for, ``auto`` resolved on this machine."""
    use_cuda = config.on_cuda()
    device = torch.device("cuda" if use_cuda else "cpu")
    if config.dtype != "auto":
        return device, getattr(torch, config.dtype)
    return device, torch.bfloat16 if use_cuda and torch.cuda.is_bf16_supported() else torch.float32


def create(config: ModelConfig, out_dir: Path, seed: int) -> Path:
    """Make the model a recipe builds, write it to ``out_dir``, and return the directory to load from.

    A recipe with ``model.path`` needs nothing made: its directory is returned.
    The initial weights depend only on ``seed``.
    """
    if config.path is not None:
        return Path(config.path)
    tokenizer = word_tokenizer(config.build.vocabulary)
    with torch.random.fork_rng(devices=[]):  # the weights depend on the seed, not on what ran before
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config(config.build, tokenizer))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load(source: Path, config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of ``source`` on the recipe's device and dtype, in eval mode (no dropout).

    A made model's word tokenizer is loaded as the generic fast tokenizer:
    transformers 5 ``AutoTokenizer`` replaces the tokenizer of any ``qwen2``
    model with Qwen2's byte-level one (``llama`` models are left alone).
    """
    device, dtype = device_and_dtype(config)
    attention = attention_implementation(config)
    tokenizer_class = PreTrainedTokenizerFast if config.build is not None else AutoTokenizer
    tokenizer = tokenizer_class.from_pretrained(source, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # left padding is masked out; any id will do
    kwargs = {} if attention is None else {"attn_implementation": attention}
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=dtype, **kwargs).to(device)
    return model.eval(), tokenizer


def attention_implementation(config: ModelConfig) -> str | None:
    """The ``attn_implementation`` to load with: the recipe's, or for ``auto`` the fastest this machine has.

    ``auto`` on a GPU: FlashAttention 2 when ``flash_attn`` is importable, else
    PyTorch's SDPA (which picks its flash or memory-efficient kernel itself);
    on a CPU None, transformers' own default.
    """
    if config.attention != "auto":
        return config.attention
    if not config.on_cuda():
        return None
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``model`` that takes no gradients (the reference policy)."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


class ValueModel(torch.nn.Module):
    """The critic: a copy of the policy's backbone and a linear head giving one value per position."""

    def __init__(self, policy: PreTrainedModel):
        super().__init__()
        self.backbone = copy.deepcopy(policy.base_model)
        self.head = torch.nn.Linear(policy.config.hidden_size, 1, dtype=policy.dtype, device=policy.device)
        torch.nn.init.zeros_(self.head.weight)  # start from V = 0 everywhere: no arbitrary initial advantages
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        """Values ``(B, L)``, one per input position."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1).float()
