"""The transformers binding keeps the cache's token count with the state bound into it (transformers >= 5.25
reads RoPE positions from a linear-attention layer's counter); any disagreement is a BindingError."""

from __future__ import annotations

import pytest
import torch

import mambacache as mc
from mambacache.hf import bind_cache, check_seq_length, drop_tokens
from mambacache.sim._models import HFModel

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen() -> HFModel:
    return HFModel("qwen3-next", seed=3)


def logits(model: HFModel, ctx: object, tokens: list[int], seen: int) -> torch.Tensor:
    # No explicit positions: the model takes them from the cache, as in a user's own loop.
    kwargs = {model._cache_kw: ctx}
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([tokens]), use_cache=True, **kwargs)
    check_seq_length(ctx, seen + len(tokens), model.config)
    return out.logits[0, -1]


@pytest.mark.parametrize("trial", range(3))
def test_a_forked_prefix_continues_exactly_as_a_one_shot_prefill(qwen: HFModel, trial: int) -> None:
    """Chunked prefix in a slot, fork by pool copy into a fresh cache object, then the suffix: the same
    next-token logits as running the whole prompt at once (the fork is where 5.25 lost positions)."""
    g = torch.Generator().manual_seed(trial)
    prompt = torch.randint(2, qwen.vocab_size, (23,), generator=g).tolist()
    prefix, suffix = prompt[:16], prompt[16:]
    pool = mc.StatePool(qwen.spec, 4)
    with mc.CacheManager(pool) as mgr:
        a, b, c = mgr.alloc(3)
        mgr.flush_nowait()
        ctx = qwen.new_context()
        qwen.bind(ctx, pool, a, 0)
        for i in range(0, 16, 8):  # chunked prefill of the prefix in slot a
            qwen.forward(ctx, prefix[i : i + 8], i)
        mgr.copy_on_write(a, b)
        mgr.flush_nowait()
        forked = qwen.restore(qwen.snapshot(ctx))  # a new cache object with the prefix's attention KV only
        qwen.bind(forked, pool, b, len(prefix))
        got = logits(qwen, forked, suffix, len(prefix))
        whole = qwen.new_context()
        qwen.bind(whole, pool, c, 0)
        want = logits(qwen, whole, prompt, 0)
    assert int(got.argmax()) == int(want.argmax())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_restored_cache_without_its_token_count_is_refused(qwen: HFModel) -> None:
    pool = mc.StatePool(qwen.spec, 2)
    ctx = qwen.new_context()
    qwen.bind(ctx, pool, 1, 0)
    qwen.forward(ctx, [5, 6, 7, 8], 0)
    restored = qwen.restore(qwen.snapshot(ctx))
    with pytest.raises(mc.BindingError, match="disagrees with the bound state"):
        bind_cache(restored, pool, 1, qwen.config, tokens=0)  # the attention KV holds 4 tokens
    bind_cache(restored, pool, 1, qwen.config, tokens=4)
    assert int(restored.get_seq_length()) == 4


def test_drop_tokens_rolls_the_count_back_and_a_corrupted_count_is_caught(qwen: HFModel) -> None:
    pool = mc.StatePool(qwen.spec, 2, draft_tokens=3)
    ctx = qwen.new_context()
    qwen.bind(ctx, pool, 1, 0)
    qwen.forward(ctx, [3, 4, 5], 0)
    for j, token in enumerate([9, 10, 11]):  # a verify forward in the draft buffers
        qwen.bind_draft(ctx, pool, 1, j, 3 + j)
        qwen.forward(ctx, [token], 3 + j)
    qwen.bind(ctx, pool, 1, 6)
    qwen.drop_tokens(ctx, 2, 4)  # two drafts rejected: every layer counts 4 again
    assert int(ctx.get_seq_length()) == 4
    assert all(int(layer.get_seq_length()) == 4 for i, layer in enumerate(ctx.layers) if i not in qwen.linear)
    counter = getattr(ctx.layers[qwen.linear[0]], "cumulative_length_linear", None)
    if counter is None:
        pytest.skip("this transformers keeps no linear-attention counter")
    counter.fill_(7)
    with pytest.raises(mc.BindingError, match=r"layer 0 \(linear\) counts 7"):
        check_seq_length(ctx, 4, qwen.config)
    with pytest.raises(mc.InvalidArgumentError):
        drop_tokens(ctx, -1, qwen.config)
    with pytest.raises(mc.InvalidArgumentError, match="tokens must be a non-negative int"):
        bind_cache(ctx, pool, 1, qwen.config, tokens=-2)


def test_the_simulator_fails_loudly_when_the_count_is_off(qwen: HFModel) -> None:
    """A forward told the wrong number of consumed tokens is a BindingError, not silently wrong tokens."""
    pool = mc.StatePool(qwen.spec, 2)
    ctx = qwen.new_context()
    qwen.bind(ctx, pool, 1, 0)
    qwen.forward(ctx, [1, 2, 3], 0)
    with pytest.raises(mc.BindingError):
        qwen.forward(ctx, [4], 5)


def test_a_transformers_older_than_the_floor_is_refused(qwen: HFModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from mambacache import hf

    pool = mc.StatePool(qwen.spec, 2)
    monkeypatch.setattr(transformers, "__version__", "5.22.2")
    hf._check_transformers.cache_clear()
    try:
        with pytest.raises(mc.BindingError, match=r"transformers 5\.22\.2 is older than 5\.23"):
            bind_cache(qwen.new_context(), pool, 1, qwen.config, tokens=0)
    finally:
        monkeypatch.undo()
        hf._check_transformers.cache_clear()
    bind_cache(qwen.new_context(), pool, 1, qwen.config, tokens=0)
