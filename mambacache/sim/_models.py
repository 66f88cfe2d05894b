"""Models the simulator drives: a pure-torch toy, and transformers' Mamba2 and Qwen3-Next.

Each request's linear-attention state lives in its pool slot: the model's cache
layers are bound to *views* of that slot, so a forward reads and writes the
pool in place, with no gather or scatter. Attention layers' KV cache (Qwen3-Next)
stays in the request's own transformers cache object.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any

import torch

from .._core._pool import StatePool
from .._core._spec import StateSpec
from ..hf import bind_cache, cache_keyword, check_seq_length
from ..hf import drop_tokens as hf_drop_tokens
from ._config import MODELS, STATE_DTYPE_NAMES

__all__ = ["MODELS", "STATE_DTYPES", "HFModel", "SimModel", "ToyModel", "build_model"]

# How the toy model stores its states; a quantised one keeps a float32 scale per slot and layer beside each.
STATE_DTYPES = dict(zip(STATE_DTYPE_NAMES, (torch.float32, torch.int8, torch.float8_e4m3fn), strict=True))
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest magnitude each stores


class SimModel(abc.ABC):
    """What the scheduler needs from a model. ``ctx`` is a request's model-side cache."""

    name: str
    spec: StateSpec
    vocab_size: int

    @abc.abstractmethod
    def new_context(self) -> Any:
        """A fresh model-side cache for one request (bound to a pool slot before each forward)."""

    # ``seen`` below is always the scheduler's own count of the tokens the bound state has
    # consumed: a model checks its cache object agrees, and takes positions from it.
    @abc.abstractmethod
    def bind(self, ctx: Any, pool: StatePool, slot: int, seen: int) -> None:
        """Point the request's state at ``slot`` of ``pool``, a state after ``seen`` tokens."""

    @abc.abstractmethod
    def bind_draft(self, ctx: Any, pool: StatePool, slot: int, j: int, seen: int) -> None:
        """Point the request's state at draft state ``j`` of ``slot`` (a verify forward runs there)."""

    def drop_tokens(self, ctx: Any, n: int, seen: int) -> None:  # noqa: B027 - a no-op default on purpose
        """Forget the last ``n`` tokens (rejected drafts), leaving ``seen``; the recurrent state is the pool's."""

    @abc.abstractmethod
    def forward(self, ctx: Any, tokens: list[int], seen: int) -> int:
        """Run ``tokens`` after ``seen`` consumed ones; return the greedy next token."""

    @abc.abstractmethod
    def snapshot(self, ctx: Any) -> Any:
        """What a prefix-cache entry keeps besides the pool slot (attention KV)."""

    @abc.abstractmethod
    def restore(self, snapshot: Any) -> Any:
        """A new context that starts from ``snapshot``."""

    @abc.abstractmethod
    def generate(self, prompt: list[int], n: int) -> list[int]:
        """The request alone: plain greedy generation with a fresh state."""


class ToyModel(SimModel):
    """A tiny recurrent LM in plain torch: a causal conv and a decaying outer-product state per layer.

    ``state_dtype="int8"`` or ``"fp8"`` stores both states quantised, each with a
    float32 scale per slot and layer in an extra pool tensor (``conv_scale``,
    ``state_scale``, shape ``()``): a forward reads ``q * scale`` and writes back
    ``q = x / scale`` with ``scale = max|x| / qmax``. Its isolated ``generate``
    runs the same quantised model, so a pool that moves the scales with the
    states matches it exactly, and one that drops them does not.
    """

    name = "toy"

    def __init__(
        self,
        seed: int = 0,
        vocab: int = 97,
        dim: int = 16,
        layers: int = 2,
        kernel: int = 3,
        state_dtype: str = "float32",
    ) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"unknown state dtype {state_dtype!r}; choose from {tuple(STATE_DTYPES)}")
        dtype = STATE_DTYPES[state_dtype]
        self.state_dtype = state_dtype
        self._qmax = _QMAX.get(dtype)
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab
        self.emb = torch.randn(vocab, dim, generator=g)
        self.conv_w = torch.randn(layers, dim, kernel, generator=g) * 0.5
        self.mix = torch.randn(layers, dim, dim, generator=g) / dim**0.5
        self.spec = StateSpec(
            num_layers=layers,
            conv_shapes=[(dim, kernel)],
            temporal_shape=(dim, dim),
            conv_dtype=dtype,
            temporal_dtype=dtype,
            extra_shapes={"conv_scale": ((), torch.float32), "state_scale": ((), torch.float32)} if self._qmax else {},
        )

    def new_context(self) -> dict[str, list[torch.Tensor]]:
        layers, spec = self.spec.num_layers, self.spec
        ctx = {
            "conv": [torch.zeros(spec.conv_shapes[0], dtype=spec.conv_dtype) for _ in range(layers)],
            "state": [torch.zeros(spec.temporal_shape, dtype=spec.temporal_dtype) for _ in range(layers)],
        }
        for name in spec.extra_shapes:
            ctx[name] = [torch.zeros(()) for _ in range(layers)]  # scale 0: a zero state, as a cleared slot holds
        return ctx

    def bind(self, ctx: Any, pool: StatePool, slot: int, seen: int) -> None:
        layers = range(self.spec.num_layers)
        ctx["conv"] = [pool.conv[0][layer, slot] for layer in layers]
        ctx["state"] = [pool.temporal[layer, slot] for layer in layers]
        for name, t in pool.extra.items():
            ctx[name] = [t[layer, slot] for layer in layers]

    def bind_draft(self, ctx: Any, pool: StatePool, slot: int, j: int, seen: int) -> None:
        assert pool.draft_temporal is not None
        layers = range(self.spec.num_layers)
        ctx["conv"] = [pool.draft_conv[0][layer, slot, j] for layer in layers]
        ctx["state"] = [pool.draft_temporal[layer, slot, j] for layer in layers]
        for name, t in pool.draft_extra.items():
            ctx[name] = [t[layer, slot, j] for layer in layers]

    def _load(self, ctx: Any, name: str, layer: int) -> torch.Tensor:
        """State ``name`` of ``layer`` as float32: the bound view itself, or ``q * scale`` when quantised."""
        q: torch.Tensor = ctx[name][layer]
        return q if self._qmax is None else q.float() * ctx[f"{name}_scale"][layer]

    def _store(self, ctx: Any, name: str, layer: int, value: torch.Tensor) -> None:
        """Write ``value`` into state ``name`` of ``layer``, quantised with a fresh scale when the model is."""
        q = ctx[name][layer]
        if self._qmax is None:
            q.copy_(value)
            return
        scale = value.abs().amax().clamp_min(1e-12) / self._qmax
        ctx[f"{name}_scale"][layer].copy_(scale)
        scaled = value / scale
        q.copy_(scaled.round().clamp(-127, 127) if q.dtype == torch.int8 else scaled)

    def forward(self, ctx: Any, tokens: list[int], seen: int) -> int:
        x = self.emb[0]
        for token in tokens:
            x = self.emb[token]
            for layer in range(self.spec.num_layers):
                conv = torch.cat([self._load(ctx, "conv", layer)[:, 1:], x[:, None]], dim=1)
                self._store(ctx, "conv", layer, conv)
                c = (conv * self.conv_w[layer]).sum(-1)
                state = self._load(ctx, "state", layer) * 0.9 + torch.outer(c, torch.tanh(self.mix[layer] @ c))
                self._store(ctx, "state", layer, state)
                x = torch.tanh(state @ c) + x
        return int((self.emb @ x).argmax())

    def snapshot(self, ctx: Any) -> None:
        return None

    def restore(self, snapshot: Any) -> Any:
        return self.new_context()

    def generate(self, prompt: list[int], n: int) -> list[int]:
        ctx = self.new_context()
        out = [self.forward(ctx, prompt, 0)]
        while len(out) < n:
            out.append(self.forward(ctx, [out[-1]], len(prompt) + len(out) - 1))
        return out


def _hf_config(kind: str) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": None,
    }
    if kind == "mamba2":
        return transformers.Mamba2Config(
            state_size=16, num_heads=8, head_dim=16, n_groups=1, expand=2, conv_kernel=4,
            num_hidden_layers=2, chunk_size=8, **common,
        )  # fmt: skip
    return transformers.Qwen3NextConfig(
        intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"] * 2, **common,
    )  # fmt: skip


class HFModel(SimModel):
    """A transformers model with a small random config built locally (nothing is downloaded)."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        import transformers

        from .._core._hfconfig import linear_layer_indices

        self.name = kind
        self.config = _hf_config(kind)
        cls = transformers.Mamba2ForCausalLM if kind == "mamba2" else transformers.Qwen3NextForCausalLM
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = cls(self.config).float().eval()  # type: ignore[no-untyped-call]
        self.vocab_size = self.config.vocab_size
        self.linear = linear_layer_indices(self.config)
        self.spec = StateSpec.from_hf_config(self.config, conv_dtype=torch.float32, temporal_dtype=torch.float32)
        self._cache_cls = transformers.DynamicCache
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = cache_keyword(self.model)
        self._positions = "position_ids" in params  # RoPE models: positions from the scheduler's count

    def new_context(self) -> Any:
        return self._cache_cls(config=self.config)

    def bind(self, ctx: Any, pool: StatePool, slot: int, seen: int) -> None:
        bind_cache(ctx, pool, slot, self.config, tokens=seen)

    def bind_draft(self, ctx: Any, pool: StatePool, slot: int, j: int, seen: int) -> None:
        bind_cache(ctx, pool, slot, self.config, draft=j, tokens=seen)

    def drop_tokens(self, ctx: Any, n: int, seen: int) -> None:
        hf_drop_tokens(ctx, n, self.config)
        check_seq_length(ctx, seen, self.config)

    def forward(self, ctx: Any, tokens: list[int], seen: int) -> int:
        kwargs: dict[str, Any] = {self._cache_kw: ctx}
        if self._positions:
            kwargs["position_ids"] = torch.arange(seen, seen + len(tokens))[None]
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([tokens]), use_cache=True, **kwargs)
        check_seq_length(ctx, seen + len(tokens), self.config)
        return int(out.logits[0, -1].argmax())

    def snapshot(self, ctx: Any) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        linear = set(self.linear)
        return [
            (i, layer.keys.clone(), layer.values.clone())
            for i, layer in enumerate(ctx.layers)
            if i not in linear and getattr(layer, "is_initialized", False)
        ]

    def restore(self, snapshot: Any) -> Any:
        ctx = self.new_context()
        for i, keys, values in snapshot:
            layer = ctx.layers[i]
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys.clone(), values.clone()
        return ctx

    def generate(self, prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
            )
        return [int(t) for t in out[0, len(prompt) :]]


def build_model(name: str, seed: int = 0, state_dtype: str = "float32") -> SimModel:
    """The simulator's model ``name`` (``toy``, ``mamba2``, ``qwen3-next``), random weights from ``seed``, built
    locally: nothing is downloaded. ``state_dtype`` (``float32``, ``int8``, ``fp8``): how the toy model stores
    its states; the transformers models keep float32 states."""
    if name == "toy":
        return ToyModel(seed, state_dtype=state_dtype)
    if state_dtype != "float32":
        raise ValueError(f"state_dtype {state_dtype!r} is for the toy model; {name} keeps float32 states")
    if name in ("mamba2", "qwen3-next"):
        try:
            return HFModel(name, seed)
        except ImportError as exc:
            raise ImportError(f"--model {name} needs transformers: pip install 'mambacache[hf]'") from exc
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
