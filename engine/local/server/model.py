"""The language-model backend of the embedded server: a causal LM on the CPU plus its sampler.

The default model is a tiny, randomly initialised Qwen3 built deterministically (no download);
its vocabulary matches the real Qwen3 tokenizer, so ids, special tokens and chat templates are
the real ones even though the text it samples is gibberish.

Logprobs follow SGLang's sampler: the reported logprob of a token is its log-probability under
the temperature-scaled distribution over the whole vocabulary (top-p / top-k only restrict which
token gets drawn, they do not renormalise the reported value); a greedy request reports
`log_softmax` of the raw logits.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import attrs
import torch

from engine.profiles.tokenizer import default_tokenizer_dir, load_tokenizer

DEFAULT_MODEL_NAME = "qwen3-tiny-random"
GREEDY_TEMPERATURE = 1e-6  # SGLang turns anything below this into greedy decoding
_QWEN_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")


def tiny_qwen3() -> torch.nn.Module:
    """The default model: a 9.8 M-parameter Qwen3ForCausalLM with weights fixed by seed 0."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    # fork_rng: the weights depend on seed 0 only, and callers' global RNG state is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    return model.eval()


@attrs.frozen
class SamplerParams:
    """The parts of `sampling_params` that shape the next-token distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (SGLang: temperature below 1e-6)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def reported_logprobs(logits: torch.Tensor, params: SamplerParams) -> torch.Tensor:
    """Log-probabilities SGLang reports for `logits` (last dim = vocabulary)."""
    logits = logits.float()
    if not params.greedy:  # greedy requests report raw log_softmax, as SGLang's all-greedy path does
        logits = logits / params.temperature
    # Clamped like SGLang, so an impossible token gives a huge negative number, never -inf (not JSON).
    return torch.log_softmax(logits, dim=-1).clamp(min=torch.finfo(torch.float32).min)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw from unnormalised probs: much cheaper than torch.multinomial over a 150k
    vocabulary on the CPU, and just as deterministic for a seeded generator."""
    cdf = torch.cumsum(probs.double(), dim=0)
    threshold = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, threshold, right=True)), probs.numel() - 1)


def _candidates(probs: torch.Tensor, params: SamplerParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(probabilities, ids) of the tokens a top-k / top-p cut keeps, best first, the cut ones at 0;
    None when there is no cut."""
    if not (0 < params.top_k < probs.numel() or params.top_p < 1.0):
        return None
    # Candidates in descending order: the top_k best, or the whole vocabulary for top_p alone.
    if 0 < params.top_k < probs.numel():
        cand, order = torch.topk(probs, params.top_k)
    else:
        cand, order = torch.sort(probs, descending=True)
    if params.top_p < 1.0:
        before = torch.cumsum(cand, dim=0) - cand
        # Keep a token while the mass before it is below top_p, so the best token always stays.
        cand = cand.masked_fill(before >= params.top_p * cand.sum(), 0.0)
    return cand, order


def kept_token_ids(logits: torch.Tensor, params: SamplerParams) -> list[int]:
    """The ids the sampler could have drawn from these logits (slime's top-p replay), best first."""
    logprobs = reported_logprobs(logits, params)
    if params.greedy:
        return [int(torch.argmax(logprobs))]
    nucleus = _candidates(logprobs.exp(), params)
    if nucleus is None:
        return list(range(logprobs.numel()))
    cand, order = nucleus
    return order[cand > 0].tolist()


def synthetic_routed_experts(tokens: list[int], start: int, layers: int, topk: int, experts: int = 64) -> list[int]:
    """Deterministic routed experts, flattened int32 rows `[start, len(tokens) - 1)` of `layers x topk`.

    A stand-in for an MoE router: the row of position p depends on p and its token only, so a
    test can recompute what the server sent; the k ids of one layer are distinct.
    """
    out: list[int] = []
    for p in range(start, len(tokens) - 1):
        for layer in range(layers):
            base = (tokens[p] * 31 + p * 17 + layer * 7) % experts
            out.extend((base + k) % experts for k in range(topk))
    return out


def sample_token(logits: torch.Tensor, params: SamplerParams, generator: torch.Generator) -> tuple[int, float]:
    """Draw one token from a 1-D logits vector; returns (token id, reported logprob)."""
    logprobs = reported_logprobs(logits, params)
    if params.greedy:
        token = int(torch.argmax(logprobs))
        return token, float(logprobs[token])
    probs = logprobs.exp()
    nucleus = _candidates(probs, params)
    if nucleus is not None:
        cand, order = nucleus
        token = int(order[_draw(cand, generator)])
    else:
        token = _draw(probs, generator)
    return token, float(logprobs[token])


class LMBackend:
    """A causal LM and its tokenizer, with KV-cached prefill / decode / teacher-forcing helpers.

    Not thread-safe by itself: the scheduler calls it from its single worker thread.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, model_path: str, tokenizer_path: str,
                 served_model_name: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.served_model_name = served_model_name
        config = model.config
        self.model_type: str = getattr(config, "model_type", "unknown")
        self.architectures: list[str] = list(getattr(config, "architectures", None) or [type(model).__name__])
        self.vocab_size: int = int(config.vocab_size)
        # Ids past the tokenizer's vocabulary are padding rows of the embedding: a random model
        # would sample them and they decode to nothing, so the sampler never draws them.
        self.sample_vocab: int = min(self.vocab_size, len(tokenizer))
        self.eos_ids: frozenset[int] = self._eos_ids()
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @classmethod
    def load(cls, model_path: str | None = None, tokenizer_path: str | None = None,
             served_model_name: str | None = None) -> LMBackend:
        """Load the default tiny Qwen3 (`model_path=None`) or a local HF causal LM, offline."""
        if model_path is None:
            tok_dir = tokenizer_path or default_tokenizer_dir()
            model = tiny_qwen3()
            # The router loads the tokenizer named by model_path: it must be a local directory.
            reported_model_path = tok_dir
            name = served_model_name or DEFAULT_MODEL_NAME
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32).eval()
            has_tokenizer = os.path.isfile(os.path.join(model_path, "tokenizer.json")) or os.path.isfile(
                os.path.join(model_path, "tokenizer_config.json"))
            tok_dir = tokenizer_path or (model_path if has_tokenizer else default_tokenizer_dir())
            reported_model_path = model_path
            name = served_model_name or model_path
        return cls(model, load_tokenizer(tok_dir), model_path=reported_model_path, tokenizer_path=tok_dir,
                   served_model_name=name)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        for token in _QWEN_EOS_TOKENS:
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        return frozenset(ids)

    # ---- tokenizer -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special-token strings such as `<|im_end|>` included as ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- forward passes ----------------------------------------------------------------------
    def _forward(self, ids: list[int], cache: Any, keep: int) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True,
                             logits_to_keep=keep, **{self._cache_kwarg: cache})
        logits = out.logits[0]
        return logits[:, : self.sample_vocab]

    def new_cache(self) -> Any:
        """An empty KV cache, filled in place by `prefill` / `extend`."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def prefill(self, ids: list[int], cache: Any) -> torch.Tensor:
        """Run the prompt; returns the logits (1-D) for the next token."""
        return self._forward(ids, cache, keep=1)[-1]

    def step(self, token: int, cache: Any) -> torch.Tensor:
        """Feed one token; returns the logits for the token after it."""
        return self._forward([token], cache, keep=1)[-1]

    def score(self, prompt: list[int], continuation: list[int], cache: Any) -> torch.Tensor:
        """Logits predicting each token of `continuation` after `prompt`, in one forward pass."""
        return self._forward(prompt + continuation, cache, keep=len(continuation) + 1)[:-1]
