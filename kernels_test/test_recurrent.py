"""The recurrent layers' kernels: the chunked delta rule against the
step-by-step one and against transformers' own torch forms, and the short
causal convolution with its window carried across calls and batched over slots."""

from __future__ import annotations

import pytest
import torch

from strata_kernels.recurrent import (RecurrentStore, causal_conv, causal_conv_step, delta_rule_chunked,
                                      delta_rule_prefill, delta_rule_recurrent, delta_rule_step)


def _inputs(t: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1)
    v = torch.randn(t, hv, dv, generator=g)
    decay = -torch.rand(t, hv, generator=g) * 0.3  # log decays: exp in (0.74, 1]
    beta = torch.rand(t, hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g) * 0.2
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["hk=hv", "hv=2hk"])
def test_chunked_equals_step_by_step(t, heads):
    q, k, v, g, beta, state = _inputs(t, *heads, 16, 8, seed=t)
    s1, s2 = state.clone(), state.clone()
    step = delta_rule_recurrent(q, k, v, g, beta, s1)
    chunked = delta_rule_chunked(q, k, v, g, beta, s2)
    torch.testing.assert_close(chunked, step, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s2, s1, atol=2e-5, rtol=1e-5)


def test_against_transformers_torch_forms():
    """transformers' reference functions (which normalize q and k themselves)
    give what ours give from the normalized inputs."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                    torch_recurrent_gated_delta_rule)

    g = torch.Generator().manual_seed(0)
    t, hk, hv, dk, dv = 150, 2, 4, 16, 8
    q, k, v = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g), torch.randn(t, hv, dv, generator=g)
    decay, beta, state = -torch.rand(t, hv, generator=g) * 0.5, torch.rand(t, hv, generator=g), torch.randn(hv, dk, dv)
    qn = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
    kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    for theirs in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
        want, want_state = theirs(q[None], k[None], v[None], decay[None], beta[None], initial_state=state[None],
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        ours_state = state.clone()
        ours = delta_rule_chunked(qn, kn, v, decay, beta, ours_state)
        torch.testing.assert_close(ours, want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours_state, want_state[0], atol=1e-5, rtol=1e-5)


def test_the_step_form_updates_only_its_slots():
    """Decode: three sequences in slots 4, 0, 2 of a store of 5; the others untouched."""
    store = RecurrentStore.allocate(5, 3, 12, 4, 16, 8)
    store.state.normal_()
    before = store.state.clone()
    slots = torch.tensor([4, 0, 2])
    q, k, v, g, beta, _ = _inputs(3, 2, 4, 16, 8, seed=1)
    out = delta_rule_step(q, k, v, g, beta, store.state, slots)
    for i, s in enumerate(slots.tolist()):
        alone = before[s].clone()
        want = delta_rule_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], alone)
        torch.testing.assert_close(out[i:i + 1], want)
        torch.testing.assert_close(store.state[s], alone)
    assert torch.equal(store.state[[1, 3]], before[[1, 3]])


def test_the_convolution_carries_its_window_across_calls():
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(40, 12, generator=g), torch.randn(12, 4, generator=g)
    whole = causal_conv(x, weight, torch.zeros(3, 12))
    window = torch.zeros(3, 12)
    parts = [causal_conv(x[a:b], weight, window) for a, b in ((0, 2), (2, 17), (17, 40))]
    torch.testing.assert_close(torch.cat(parts), whole)
    # One token at a time through a slot of a store, as decode runs it.
    conv = torch.zeros(2, 3, 12)
    steps = [causal_conv_step(x[i:i + 1], weight, conv, torch.tensor([1])) for i in range(40)]
    torch.testing.assert_close(torch.cat(steps), whole)
    assert torch.equal(conv[0], torch.zeros(3, 12))
    # The first output sees only its own input (zeros before the sequence).
    torch.testing.assert_close(whole[0], x[0] * weight[:, -1])


def _backends():
    from strata_kernels import cpu_kernels

    return ["triton"] + (["cpu"] if cpu_kernels.available() else [])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("shape", [(3, 2, 4, 16, 16), (2, 1, 3, 24, 40)], ids=["pow2", "odd-dims"])
def test_decode_step_backends_equal_the_reference(backend, shape):
    """The compiled CPU step and the Triton step (under the interpreter)
    against the torch reference: outputs and the states left in the slots."""
    b, hk, hv, dk, dv = shape
    g = torch.Generator().manual_seed(5)
    ref_store = RecurrentStore.allocate(5, 3, 2 * hk * dk + hv * dv, hv, dk, dv)
    ref_store.state.normal_(generator=g)
    ref_store.conv.normal_(generator=g)
    store = RecurrentStore(ref_store.conv.clone(), ref_store.state.clone())
    slots = torch.tensor([3, 0, 4][:b])
    for step in range(3):  # states carried from step to step
        q, k, v, decay, beta, _ = _inputs(b, hk, hv, dk, dv, seed=step)
        want = delta_rule_step(q, k, v, decay, beta, ref_store.state, slots)
        got = delta_rule_step(q, k, v, decay, beta, store.state, slots, backend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(store.state, ref_store.state, atol=1e-5, rtol=1e-5)
        x, weight = torch.randn(b, store.conv.shape[2], generator=g), torch.randn(store.conv.shape[2], 4, generator=g)
        want = causal_conv_step(x, weight, ref_store.conv, slots)
        got = causal_conv_step(x, weight, store.conv, slots, backend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(store.conv, ref_store.conv)


@pytest.mark.skipif(not __import__("strata_kernels").cpu_kernels.available(), reason="the CPU kernels did not build")
@pytest.mark.parametrize("t", [1, 70])
def test_the_cpu_prefill_scan_equals_its_decode_steps(t):
    """On the CPU kernels a prompt runs as one scan (heads in parallel, each
    state in cache for every token): bit for bit the decode step's arithmetic,
    token by token, and within rounding of the chunked form."""
    q, k, v, g, beta, state = _inputs(t, 2, 4, 16, 32, seed=7)
    scanned_state, stepped = state.clone(), state.clone()[None]
    scanned = delta_rule_prefill(q, k, v, g, beta, scanned_state, "cpu")
    slot = torch.zeros(1, dtype=torch.long)
    steps = torch.cat([delta_rule_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], stepped, slot,
                                       "cpu") for i in range(t)])
    assert torch.equal(scanned, steps) and torch.equal(scanned_state, stepped[0])
    chunked_state = state.clone()
    torch.testing.assert_close(scanned, delta_rule_chunked(q, k, v, g, beta, chunked_state), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(scanned_state, chunked_state, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_decode_step_at_a_real_shape(b):
    """Qwen3-Next 80B's recurrent heads (16 key, 32 value, 128 x 128): the
    compiled Triton step and convolution against the torch reference on the GPU."""
    hk, hv, dk, dv = 16, 32, 128, 128
    store = RecurrentStore.allocate(16, 3, 2 * hk * dk + hv * dv, hv, dk, dv, "cuda")
    store.state.normal_(std=0.05)
    store.conv.normal_()
    ref = RecurrentStore(store.conv.clone(), store.state.clone())
    slots = torch.arange(b, device="cuda") * 2
    q, k, v, g, beta, _ = (t.cuda() for t in _inputs(b, hk, hv, dk, dv, seed=b))
    got = delta_rule_step(q, k, v, g, beta, store.state, slots, "triton")
    want = delta_rule_step(q, k, v, g, beta, ref.state, slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(store.state, ref.state, atol=1e-4, rtol=1e-4)
    x, weight = torch.randn(b, store.conv.shape[2], device="cuda"), torch.randn(store.conv.shape[2], 4, device="cuda")
    torch.testing.assert_close(causal_conv_step(x, weight, store.conv, slots, "triton"),
                               causal_conv_step(x, weight, ref.conv, slots), atol=1e-4, rtol=1e-4)
    assert torch.equal(store.conv, ref.conv)


@pytest.mark.parametrize("t", [5, 32, 77])
@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (1, 2, 24, 40)], ids=["pow2", "odd-dims"])
def test_the_triton_chunked_prefill_equals_the_recurrence(t, dims):
    """The Triton chunked kernel (under the interpreter): chunks of 32, the
    triangular solve as a product of powers, padded tails."""
    hk, hv, dk, dv = dims
    q, k, v, g, beta, state = _inputs(t, hk, hv, dk, dv, seed=t)
    want_state, got_state = state.clone(), state.clone()
    want = delta_rule_recurrent(q, k, v, g, beta, want_state)
    got = delta_rule_prefill(q, k, v, g, beta, got_state, "triton")
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch"] + _backends())
def test_every_prefill_form_holds_on_alike_keys_with_full_writes(backend):
    """Keys nearly alike, beta 1, no decay: the within-chunk system is then
    far from the identity (its inverse's entries grow with the chunk), where
    a solve by products of powers lost every digit. Each form against the
    token-by-token recurrence."""
    g = torch.Generator().manual_seed(9)
    t, hk, hv, dk, dv = 100, 2, 4, 32, 32
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(1, hk, dk, generator=g) + 0.3 * torch.randn(t, hk, dk, generator=g),
                                      dim=-1)
    v, decay, beta = torch.randn(t, hv, dv, generator=g), torch.zeros(t, hv), torch.ones(t, hv)
    state = torch.randn(hv, dk, dv, generator=g) * 0.1
    want_state, got_state = state.clone(), state.clone()
    want = delta_rule_recurrent(q, k, v, decay, beta, want_state)
    got = delta_rule_prefill(q, k, v, decay, beta, got_state, backend)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=3e-5, rtol=1e-5)
