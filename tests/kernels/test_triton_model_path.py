"""The GPU worker's model path, run on the CPU under Triton's interpreter: a tiny Llama whose
attention (TritonAttentionBackend), RMSNorm with residual, rotary, SiLU-and-multiply and token
draw all go through the Triton kernels, stepped through the padded buffers a CUDA graph replays,
gives the tokens and log-probs of the plain CPU path (torch ops, CPU backend). Plus the routing
itself: which tensors go to the Triton ops, and the off switch."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from helpers import assert_same_steps, save_tiny_llama  # noqa: E402
from kernels.cpu import fused as cpu_fused  # noqa: E402
from kernels.triton import fused as triton_fused  # noqa: E402
from kernels.triton import interpreting  # noqa: E402
from kernels.triton.rotary import rotary_embedding, rotary_embedding_ref, rotary_embedding_rows  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the Triton kernels on CPU tensors")

BLOCK_SIZE = 16
VOCAB = 128


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_triton"), VOCAB, 96, 128, 6, 2, 16, 256)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route CPU tensors to the Triton ops (and away from the native CPU kernels)."""
    from kernels.attention.triton_backend import TritonAttentionBackend
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    monkeypatch.setattr(cpu_fused, "ENABLED", False)
    monkeypatch.setattr(TritonAttentionBackend, "devices", ("cuda", "cpu"))


def _count_calls(monkeypatch) -> dict[str, int]:
    calls = dict.fromkeys(("rms_norm", "rotary_", "silu_and_mul", "sample"), 0)
    for name in calls:
        fn = getattr(triton_fused, name)

        def counted(*args, _fn=fn, _name=name):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(triton_fused, name, counted)
    return calls


def _scenario(path: str, dtype: torch.dtype, triton: bool):
    from actors.worker.cuda_graphs import capture_sizes
    from kernels.attention.cpu import CpuAttentionBackend
    from kernels.attention.triton_backend import TritonAttentionBackend
    from models.registry import load_model
    from models.resolve import resolve_model
    from tools.gpu_check.driver import build_runner, padding_scenario
    backend = TritonAttentionBackend() if triton else CpuAttentionBackend()
    model, config = load_model(resolve_model(path), dtype, attn_backend=backend, block_size=BLOCK_SIZE)
    runner, _ = build_runner(model, config, "cpu", dtype, graphs=triton, max_num_seqs=8, num_blocks=96,
                             block_size=BLOCK_SIZE, max_model_len=256)
    assert capture_sizes(8) == [1, 2, 4, 8]
    return padding_scenario(runner, BLOCK_SIZE, VOCAB, decode_steps=(5, 4, 2))   # the interpreter is slow


def test_gpu_model_path_gives_the_cpu_paths_tokens_and_logprobs(tiny_llama, triton_on_cpu, monkeypatch):
    """float32, through the padded graph buffers, greedy rows and a seeded top-k row."""
    with monkeypatch.context() as plain:
        plain.setattr(triton_fused, "ON_CPU", False)
        plain.setattr(cpu_fused, "ENABLED", True)
        expected = _scenario(tiny_llama, torch.float32, triton=False)
    calls = _count_calls(monkeypatch)
    got = _scenario(tiny_llama, torch.float32, triton=True)
    # every op went through Triton: 2 norms + rotary + SiLU per layer (2 layers) per step, the
    # final norm, and the draws of the steps holding the seeded row (greedy-only steps take argmax)
    assert calls["rotary_"] > 0 and calls["silu_and_mul"] == calls["rotary_"]
    assert calls["rms_norm"] == calls["rotary_"] * 2 + calls["rotary_"] // 2
    assert calls["sample"] > 0
    assert_same_steps(expected, got, atol=1e-4)


def test_gpu_model_path_in_bfloat16_gives_the_cpu_paths_logits(tiny_llama, triton_on_cpu, monkeypatch):
    """bfloat16 (the GPU worker's dtype), teacher-forced so that one near-tie cannot fork the two
    runs: a prefill of two prompts, then decode steps, logits within bfloat16 rounding."""
    from helpers import run_steps
    from kernels.attention import allocate_kv_caches
    from kernels.attention.cpu import CpuAttentionBackend
    from kernels.attention.triton_backend import TritonAttentionBackend
    from models.registry import load_model
    from models.resolve import resolve_model
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (37,), generator=g), torch.randint(1, VOCAB, (5,), generator=g)]
    steps = [prompts] + [[torch.tensor([7 + s]), torch.tensor([11 + s])] for s in range(4)]

    def logits(backend, dtype) -> torch.Tensor:
        model, config = load_model(resolve_model(tiny_llama), dtype, attn_backend=backend, block_size=BLOCK_SIZE)
        caches = allocate_kv_caches(config, 16, BLOCK_SIZE, dtype)
        return run_steps(model, caches, [[1, 2, 3], [4]], steps, BLOCK_SIZE).float()

    with monkeypatch.context() as plain:
        plain.setattr(triton_fused, "ON_CPU", False)
        exact = logits(CpuAttentionBackend(), torch.float32)
        cpu_bf16 = logits(CpuAttentionBackend(), torch.bfloat16)
    calls = _count_calls(monkeypatch)
    ours = logits(TritonAttentionBackend(), torch.bfloat16)
    assert calls["rotary_"] == 2 * len(steps) and calls["silu_and_mul"] == 2 * len(steps)
    # as close to the float32 logits as the CPU's own bfloat16 path is
    err_ours, err_cpu = (ours - exact).abs(), (cpu_bf16 - exact).abs()
    # (measured: mean 0.0242 vs 0.0241, max 0.169 vs 0.178)
    assert err_ours.mean() <= 1.1 * err_cpu.mean() and err_ours.max() <= 1.25 * err_cpu.max()
    top2 = exact.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err_ours.max()   # rows whose top token no error can flip
    assert clear.sum() >= 10
    assert torch.equal(ours.argmax(-1)[clear], exact.argmax(-1)[clear])


def test_off_switch_and_cpu_tensors_keep_the_torch_ops(monkeypatch):
    x = torch.randn(3, 8)
    assert not triton_fused.supports(x)                      # CPU tensors: not without ON_CPU
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    assert triton_fused.supports(x, torch.ones(8))
    assert not triton_fused.supports(x.t())                  # last dimension not contiguous
    monkeypatch.setattr(triton_fused, "ENABLED", False)      # TROUPE_TRITON_OPS=0
    assert not triton_fused.supports(x)


def test_sampler_draws_through_the_kernel_only_when_it_can(triton_on_cpu, monkeypatch):
    """The kernel takes temperature / top-k / top-p rows; min_p or processed log-probs keep the
    torch chain. Both give the same tokens from the same seeded generators."""
    from models.sampler import Sampler, SamplingMetadata
    calls = _count_calls(monkeypatch)
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)) * 3
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(6)]   # noqa: E731
    kw = dict(temperature=[0.0, 0.7, 1.0, 1.3, 0.5, 1e-6], top_k=[0, 5, 0, 40, 0, 0],
              top_p=[1.0, 1.0, 0.8, 0.9, 1.0, 1.0])
    got = Sampler()(logits, SamplingMetadata.from_lists(generators=gens(), **kw)).sampled_token_ids
    assert calls["sample"] == 1
    monkeypatch.setattr(triton_fused, "ON_CPU", False)
    want = Sampler()(logits, SamplingMetadata.from_lists(generators=gens(), **kw)).sampled_token_ids
    assert got.tolist() == want.tolist()
    assert got[0] == logits[0].argmax() and got[5] == logits[5].argmax()
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    Sampler()(logits, SamplingMetadata.from_lists(generators=gens(), min_p=[0.0, 0.1, 0, 0, 0, 0], **kw))
    Sampler()(logits, SamplingMetadata.from_lists(generators=gens(), max_num_logprobs=2, logprobs_mode="processed_logprobs",
                                                  **kw))
    assert calls["sample"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("width", [16, 10])
def test_rotary_rows_equal_the_position_gathering_kernel(dtype, width):
    """Per-token cos/sin rows (the layers' (T, 1, D) layout, halves repeated) rotate q and k like
    the kernel gathering cos|sin by position, on strided views of a fused qkv tensor; a width
    below the head size leaves the rest of each head alone."""
    T, H, KVH, D = 7, 6, 2, 16
    torch.manual_seed(0)
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(dtype)
    q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    positions = torch.tensor([0, 5, 3, 17, 9, 2, 30])
    angles = torch.outer(torch.arange(32).float(), torch.rand(width // 2))          # (32, width/2)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)                           # vLLM's cos | sin
    cos = torch.cat([angles.cos()] * 2, dim=-1)[positions].to(dtype)[:, None, :]      # (T, 1, width)
    sin = torch.cat([angles.sin()] * 2, dim=-1)[positions].to(dtype)[:, None, :]
    want = rotary_embedding_ref(positions, q, k, cache.to(dtype))
    by_position = rotary_embedding(positions, q, k, cache.to(dtype), inplace=False)
    q_in, k_in = q.clone(), k.clone()
    rotary_embedding_rows(q, k, cos, sin)                                             # in place
    for got, ref, pos in zip((q, k), want, by_position):
        torch.testing.assert_close(got, pos, rtol=0, atol=0)
        torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(q[..., width:], q_in[..., width:]) and torch.equal(k[..., width:], k_in[..., width:])


def test_rotary_rows_refuse_bad_shapes():
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="cos has shape"):
        rotary_embedding_rows(q, k, torch.ones(3, 8), torch.ones(4, 8))
    with pytest.raises(ValueError, match="same even width"):
        rotary_embedding_rows(q, k, torch.ones(4, 6), torch.ones(4, 8))
    with pytest.raises(ValueError, match="same even width"):
        rotary_embedding_rows(q, k, torch.ones(4, 1, 10), torch.ones(4, 1, 10))
