"""The transformers backend (--model-impl transformers; auto's fallback): architectures Troupe has
no class of, served by transformers' modeling code with their attention over the paged KV cache.
Each is a tiny random checkpoint written by transformers, checked against transformers' own
forward: prompts whole, chunked, token by token and several requests in one step (transformers
sees a step's tokens as one sequence: the backend keeps the requests apart), sliding windows, and
the engine's greedy tokens; what it cannot serve is refused by name."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import hf_greedy, run_steps, save_tiny_llama, save_tiny_tokenizer
from kernels.attention import allocate_kv_caches
from models.registry import load_model, model_config
from models.resolve import resolve_model

VOCAB, BS = 96, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model_type -> its config's own keys beside SMALL's (experts, windows)
ARCHITECTURES = {
    "apertus": {},                                         # xIELU MLP, per-head q/k norms, Llama 3's rope
    "arcee": {},                                           # an ungated ReLU^2 MLP
    "nemotron": {"partial_rotary_factor": 0.5},            # LayerNorm1p, squared ReLU, a partial rotary
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2, "rotary_dim": 8},   # experts, q/k norms
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2},   # experts beside a shared one, q/k norms
    "vaultgemma": {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
}


def _write(path, model_type: str, seed: int = 0, own_keys: bool = False, **extra) -> tuple[str, torch.nn.Module]:
    """A tiny random checkpoint of ``model_type`` at SMALL's sizes (``own_keys``: only those of
    SMALL's keys its config class declares) -> (path, transformers' model of it)."""
    import inspect

    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    cls = CONFIG_MAPPING[model_type]
    small = SMALL
    if own_keys:
        params = inspect.signature(cls.__init__).parameters
        small = {k: v for k, v in SMALL.items() if k in params or k in cls.__annotations__}
    config = cls(**{**small, **ARCHITECTURES.get(model_type, {}), **extra})
    torch.manual_seed(seed)
    hf = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config)
    with torch.no_grad():       # spread out, so that a wrong row, position or window changes the logits
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.15)
    hf.save_pretrained(path)
    return save_tiny_tokenizer(path, VOCAB), hf.eval()


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    return _write(tmp_path_factory.mktemp(request.param), request.param)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _want(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


def test_a_prompt_whole_chunked_and_token_by_token_gives_transformers_logits(checkpoint):
    path, hf = checkpoint
    model, config = load_model(resolve_model(path))
    assert type(model).__name__ == config.architecture == "TransformersForCausalLM"
    tokens = _tokens(21, 4)
    want = _want(hf, tokens)
    assert want.std() > 0.5
    for cuts in ((21,), (13, 1, 1, 1, 1, 1, 1, 1, 1), (5, 6, 3, 7)):
        steps, start = [], 0
        for n in cuts:
            steps.append([torch.tensor(tokens[start:start + n])])
            start += n
        ours = run_steps(model, allocate_kv_caches(config, 32, BS, torch.float32), [list(range(3, 10))], steps, BS)
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"cuts {cuts}: {m}")


# more architectures without a Troupe class, each with its config's defaults at SMALL's sizes (experts
# where it has them): a prompt's logits and decodes after it equal transformers' forward
MORE = ("olmo", "hunyuan_v1_dense", "dots1", "phimoe", "ministral3", "granite_swa", "granitemoe_swa", "cohere2_moe",
        "exaone_moe", "jais2", "flex_olmo", "solar_open", "afmoe", "apertus1p5_text", "bitnet", "cwm", "flint",
        "hy_v3", "hyperclovax", "kolibri1", "laguna", "mellum", "modernbert-decoder", "nanochat", "persimmon")
EXPERTS = dict(moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=1, first_k_dense_replace=1, shared_intermediate_size=32)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MORE)
def test_more_architectures_give_transformers_logits(model_type, tmp_path):
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    path, hf = _write(tmp_path, model_type, own_keys=True,
                      **{k: v for k, v in EXPERTS.items() if k in cls.__annotations__})
    model, config = load_model(resolve_model(path))
    assert config.architecture == "TransformersForCausalLM"
    tokens = _tokens(21, 4)
    steps = [[torch.tensor(tokens[:13])]] + [[torch.tensor([t])] for t in tokens[13:]]
    ours = run_steps(model, allocate_kv_caches(config, 32, BS, torch.float32), [list(range(3, 10))], steps, BS)
    want = _want(hf, tokens)
    assert want.std() > 0.05        # (Cohere's logit scale makes them small)
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_requests_in_one_step_each_attend_only_over_their_own_tokens(checkpoint):
    """transformers sees a step's tokens as one sequence; each request's rows must still be its
    own forward's: prompts in chunks beside other requests' decodes, in shuffled blocks."""
    from kernels.attention import build_attention_metadata
    path, hf = checkpoint
    model, config = load_model(resolve_model(path))
    prompts = [_tokens(n, 10 + n) for n in (9, 14, 6)]
    wants = [_want(hf, p) for p in prompts]
    blocks = (torch.randperm(15, generator=torch.Generator().manual_seed(5)) + 1).tolist()
    tables = [blocks[0:3], blocks[3:7], blocks[7:9]]
    caches = allocate_kv_caches(config, 16, BS, torch.float32)
    done = [0, 0, 0]
    for step in [(6, 4, 3), (1, 4, 1), (1, 3, 1), (1, 1, 1), (0, 1, 0), (0, 1, 0)]:     # tokens a request a step
        running = [r for r, n in enumerate(step) if n]
        meta = build_attention_metadata([step[r] for r in running], [done[r] + step[r] for r in running],
                                        [tables[r] for r in running], BS)
        ids = torch.tensor([t for r in running for t in prompts[r][done[r]:done[r] + step[r]]])
        pos = torch.tensor([p for r in running for p in range(done[r], done[r] + step[r])])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos, caches, meta))
        row = 0
        for r in running:
            n = step[r]
            torch.testing.assert_close(logits[row:row + n], wants[r][done[r]:done[r] + n], atol=1e-4, rtol=1e-4)
            row, done[r] = row + n, done[r] + n
    assert done == [9, 14, 6]


def test_model_impl_transformers_on_a_troupe_architecture_gives_troupes_logits(tmp_path):
    path = save_tiny_llama(tmp_path, VOCAB, 64, 96, 4, 2, 16, 256)
    tokens = _tokens(17, 2)
    steps = [[torch.tensor(tokens[:11])]] + [[torch.tensor([t])] for t in tokens[11:]]
    logits = {}
    for impl in ("vllm", "transformers"):
        source = dataclasses.replace(resolve_model(path), model_impl=impl)
        model, config = load_model(source)
        logits[impl] = run_steps(model, allocate_kv_caches(config, 16, BS, torch.float32), [list(range(1, 6))],
                                 steps, BS)
        assert (config.architecture == "TransformersForCausalLM") == (impl == "transformers")
    torch.testing.assert_close(logits["transformers"], logits["vllm"], atol=2e-5, rtol=1e-5)


def test_the_engine_serves_it_with_transformers_greedy_tokens(tmp_path):
    """In the engine's own processes, through the scheduler, chunked prefill, prefix caching (a
    shared prefix read back from the cache) and preemptions (a KV cache of 12 blocks): transformers'
    greedy tokens, for an architecture ``auto`` hands to the transformers backend."""
    from actors.api import LLM, SamplingParams
    path, hf = _write(tmp_path, "apertus", seed=3)
    shared = _tokens(12, 7)
    prompts = [shared + _tokens(n, 20 + n) for n in (3, 8)] + [_tokens(19, 9), _tokens(6, 4)]
    want = hf_greedy(hf, prompts, 14)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    with LLM(path, multiprocess=True, num_gpu_blocks_override=12, block_size=BS, max_num_batched_tokens=16,
             max_num_seqs=4, enable_chunked_prefill=True, enable_prefix_caching=True) as llm:
        first = [r.token_ids for r in llm.generate(prompts[:1], params, use_tqdm=False)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.client.stats.last
    assert first == want[:1] and [r.token_ids for r in outs] == want and len({tuple(t) for t in want}) == 4
    assert outs[1].num_cached_tokens >= 12 and stats.num_preemptions > 0


def test_gemma_3n_per_layer_inputs_and_kv_shared_layers_give_transformers_logits(tmp_path):
    """Gemma 3n's text model: per-layer input embeddings, AltUp, LAuReL, and its last layers reading
    the keys and values of earlier ones (each writes them to its own cache here, as computed)."""
    path, hf = _write(tmp_path, "gemma3n_text", seed=10, num_hidden_layers=4, sliding_window=5,
                      layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                      vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=4,
                      activation_sparsity_pattern=[0.0] * 4)
    model, config = load_model(resolve_model(path))
    tokens = _tokens(21, 13)
    steps = [[torch.tensor(tokens[:13])]] + [[torch.tensor([t])] for t in tokens[13:]]
    ours = run_steps(model, allocate_kv_caches(config, 32, BS, torch.float32), [list(range(3, 10))], steps, BS)
    want = _want(hf, tokens)
    assert want.std() > 0.05        # (its final softcap keeps the logits small)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)


def test_a_multimodal_checkpoint_serves_its_language_model_on_text(tmp_path):
    """A LLaVA checkpoint (a CLIP vision tower, a projector, a Llama language model) served with
    vLLM's --language-model-only, through the transformers backend and Troupe's own class: its
    language model alone is built and read, its logits on text those of transformers' whole model,
    the vision tower never loaded."""
    import transformers
    text = transformers.LlamaConfig(**{k: v for k, v in SMALL.items() if k not in ("pad_token_id",)})
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(9)
    hf = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(text_config=text, vision_config=vision,
                                                                             image_token_index=VOCAB - 1))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, VOCAB)
    tokens = _tokens(21, 12)
    steps = [[torch.tensor(tokens[:13])]] + [[torch.tensor([t])] for t in tokens[13:]]
    want = _want(hf.eval(), tokens)
    assert want.std() > 0.5
    for impl in ("transformers", "auto"):
        source = dataclasses.replace(resolve_model(str(tmp_path)), model_impl=impl)
        whole = model_config(source)                  # served whole by default: its images too
        assert whole.image_token_id == VOCAB - 1
        model, config = load_model(dataclasses.replace(source, language_model_only=True))
        assert config.image_token_id is None
        if impl == "transformers":
            assert type(model.hf).__name__ == "LlamaForCausalLM" and config.architecture == "TransformersForCausalLM"
        else:
            assert config.architecture == "LlavaForConditionalGeneration"
        assert not any("vision" in name or "projector" in name for name, _ in model.named_parameters())
        ours = run_steps(model, allocate_kv_caches(config, 32, BS, torch.float32), [list(range(3, 10))], steps, BS)
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_a_sequence_classifier_scores_as_transformers_does(tmp_path):
    """ArceeForSequenceClassification (no Troupe class): served as a classifier (vLLM's pooling
    runner, its last token pooled), its labels' probabilities those of transformers' classifier."""
    import transformers

    from actors.api import LLM
    config = transformers.ArceeConfig(**{**SMALL, "num_labels": 3})
    torch.manual_seed(11)
    hf = transformers.ArceeForSequenceClassification(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, VOCAB)
    prompts = [_tokens(n, 80 + n) for n in (6, 11)]
    with LLM(str(tmp_path), multiprocess=False) as llm:
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            want = hf.eval()(torch.tensor([p])).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-5, rtol=1e-4)


ENCODERS = {   # model_type -> (config keys beside the vocabulary and positions)
    "distilbert": dict(dim=64, n_layers=2, n_heads=4, hidden_dim=96),
    "electra": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, embedding_size=32),
    "albert": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                   embedding_size=32),            # one layer's weights shared by the stack
    "bert": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96),
}


@pytest.mark.parametrize("model_type", sorted(ENCODERS))
def test_an_encoder_embeds_as_transformers_does(model_type, tmp_path):
    """Bare encoder checkpoints without a Troupe class (DistilBERT, ELECTRA, ALBERT; BERT, which has
    one, by --model-impl transformers): each prompt attended whole, both ways, several in one step,
    pooled by CLS (vLLM's default for the transformers backend's embeddings) and normalized."""
    import transformers

    from actors.api import LLM
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    torch.manual_seed(14)
    hf = getattr(transformers, MODEL_MAPPING_NAMES[model_type])(
        CONFIG_MAPPING[model_type](vocab_size=VOCAB, max_position_embeddings=64, **ENCODERS[model_type])).eval()
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, VOCAB)
    prompts = [_tokens(n, 90 + n) for n in (6, 11, 3)]
    impl = "transformers" if model_type == "bert" else "auto"
    with LLM(str(tmp_path), multiprocess=False, model_impl=impl) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            want = torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, 0], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-4)


def test_ngram_speculation_verifies_drafts_with_transformers_greedy_tokens(tmp_path):
    from actors.api import LLM, SamplingParams
    path, hf = _write(tmp_path, "minimax_m2", seed=6)
    prompts = [_tokens(n, 40 + n) * 2 for n in (7, 12)]     # repeats for the n-grams to find
    want = hf_greedy(hf, prompts, 16)
    with LLM(path, multiprocess=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_min": 2, "prompt_lookup_max": 3}) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        stats = llm.client.stats.last
    assert [r.token_ids for r in outs] == want and stats.spec_num_draft_tokens > 0


def test_a_lora_adapter_on_its_layers_gives_pefts_greedy_tokens(tmp_path):
    """A PEFT adapter on Apertus' q, v, o and MLP projections (transformers' own module names),
    beside requests without it in the same steps."""
    from peft import LoraConfig, get_peft_model

    from actors.api import LLM, SamplingParams
    from actors.engine.lora import LoRARequest
    from helpers import randomize_lora
    path, hf = _write(tmp_path / "apertus", "apertus", seed=8)
    peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj",
                                                                             "down_proj"],
                                         lora_dropout=0.0, init_lora_weights=False))
    randomize_lora(peft, seed=2, scale=0.2)
    peft.save_pretrained(tmp_path / "adapter")
    prompts = [_tokens(n, 70 + n) for n in (9, 13)]
    want = hf_greedy(peft.eval(), prompts, 10)
    with peft.disable_adapter():
        plain = hf_greedy(peft, prompts, 10)
    assert want != plain
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    with LLM(path, multiprocess=False, enable_lora=True, max_lora_rank=8) as llm:
        outs = llm.generate(prompts + prompts, params, lora_request=[lora, lora, None, None], use_tqdm=False)
    assert [r.token_ids for r in outs] == want + plain


def test_as_an_embedding_model_it_pools_transformers_hidden_states(tmp_path):
    """--convert embed: the last token's final hidden state, L2-normalized (vLLM's default)."""
    from actors.api import LLM
    path, hf = _write(tmp_path, "arcee", seed=5)
    prompts = [_tokens(n, 30 + n) for n in (5, 11)]
    with LLM(path, multiprocess=False, convert="embed") as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            want = torch.nn.functional.normalize(hf.model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-5)


# -- tensor parallelism over two gloo ranks, as the checkpoints' transformers configs plan it -----------

def _tp_logits(model, config, num_kv_heads: int) -> torch.Tensor:
    local = dataclasses.replace(config, num_kv_heads=num_kv_heads)
    prompts = [torch.tensor(_tokens(n, 50 + n)) for n in (9, 6)]
    steps = [prompts] + [[torch.tensor([(5 * s + r) % VOCAB + 3]) for r in range(2)] for s in range(3)]
    return run_steps(model, allocate_kv_caches(local, 32, BS, torch.float32), [list(range(1, 8)), list(range(8, 16))],
                     steps, BS)


def _tp_rank(rank: int, world: int, paths: dict) -> dict:
    from models.tensor_parallel import shard_model
    out = {}
    for name, path in paths.items():
        model, config = load_model(resolve_model(path))
        try:
            shard_model(model, world, rank)
        except ValueError as exc:
            out[name] = str(exc)
            continue
        attn = next(m for m in model.modules() if type(m).__name__ == "TransformersAttention")
        out[name] = (attn.num_kv_heads, _tp_logits(model, config, attn.num_kv_heads))
    return out


def test_two_ranks_split_it_as_its_tp_plan_says_and_give_the_unsplit_logits(tmp_path):
    """Apertus (two KV heads: one a rank) and Nemotron with one KV head (replicated on both
    ranks); MiniMax-M2's plan (experts, gathered outputs) is refused by name."""
    from helpers import run_ranks
    paths = {"apertus": _write(tmp_path / "apertus", "apertus")[0],
             "nemotron": _write(tmp_path / "nemotron", "nemotron", num_key_value_heads=1)[0],
             "minimax_m2": _write(tmp_path / "minimax", "minimax_m2")[0]}
    ranks = run_ranks(_tp_rank, 2, tmp_path, paths)
    for name, kv in (("apertus", 1), ("nemotron", 1)):
        model, config = load_model(resolve_model(paths[name]))
        want = _tp_logits(model, config, config.num_kv_heads)
        assert want.std() > 0.5
        for r in ranks:
            assert r[name][0] == kv
            torch.testing.assert_close(r[name][1], want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert all("MiniMaxM2ForCausalLM's tensor-parallel plan splits by colwise_gather_output, moe_tp_experts, "
               "packed_colwise, rowwise_split_input" in r["minimax_m2"] for r in ranks)


def test_two_pipeline_stages_give_the_unsplit_logits(checkpoint):
    """The first stage's hidden states (its layers, no final norm) feed the second (its layers
    from them, the final norm, the logits), each stage over its own layers' KV caches."""
    import copy

    from models.pipeline_parallel import split_stage
    path, _ = checkpoint
    model, config = load_model(resolve_model(path))
    prompts = [torch.tensor(_tokens(n, 60 + n)) for n in (9, 6)]
    steps = [prompts] + [[torch.tensor([(3 * s + r) % VOCAB + 3]) for r in range(2)] for s in range(3)]
    tables = [list(range(1, 8)), list(range(8, 16))]
    want = run_steps(model, allocate_kv_caches(config, 32, BS, torch.float32), tables, steps, BS)
    first, last = (split_stage(copy.deepcopy(model), 2, r) for r in range(2))
    assert (first.start_layer, first.end_layer, last.start_layer, last.end_layer) == (0, 2, 2, 3)

    class Pipeline:
        def __call__(self, ids, pos, caches, meta):
            hidden = first(ids, pos, caches[:2], meta)
            assert set(hidden) == {"hidden_states"}
            return last(ids, pos, caches[2:], meta, intermediate=hidden)

        compute_logits = staticmethod(last.compute_logits)

    got = run_steps(Pipeline(), allocate_kv_caches(config, 32, BS, torch.float32), tables, steps, BS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_it_cannot_serve_is_refused_by_name(tmp_path):
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM
    path, _ = _write(tmp_path / "apertus", "apertus")
    with pytest.raises(ValueError, match=r"ApertusForCausalLM.* is not supported; --model-impl transformers \(or "
                                         r"auto\) serves it through transformers' modeling code"):
        model_config(dataclasses.replace(resolve_model(path), model_impl="vllm"))
    # layers of another kind than attention (MiniMax-Text's lightning attention), a model off the interface
    for arch, model_type, why in (
            ("MiniMaxForCausalLM", "minimax", "MiniMaxForCausalLM has layers of type 'linear_attention': the "
                                              "transformers backend attends full and sliding attention layers only"),
            ("OlmoHybridForCausalLM", "olmo_hybrid", "OlmoHybridForCausalLM does not call its attention through "
                                                     "transformers' attention interface")):
        hybrid = tmp_path / model_type
        hybrid.mkdir()
        (hybrid / "config.json").write_text(json.dumps({
            "architectures": [arch], "model_type": model_type, **SMALL,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"]}))
        with pytest.raises(ValueError, match=why):
            model_config(resolve_model(str(hybrid)))
    Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**{**SMALL, "kv_lora_rank": 16, "q_lora_rank": 16,
                                                 "n_routed_experts": 4})).save_pretrained(tmp_path / "mla")
    with pytest.raises(ValueError, match=r"multi-head latent attention \(kv_lora_rank\) is not supported"):
        model_config(resolve_model(str(tmp_path / "mla")))
    # attention the paged cache cannot give, found by the model's source or by a trial step at load: a mask
    # the module makes itself (Doge's dynamic mask), two attentions a layer (DiffLlama's differential
    # attention), a layer run again in a loop (Dory's recurrent depth)
    for model_type, why in (("doge", "DogeAttention .* attends under a mask of its own making"),
                            ("diffllama", r"layer 0 \(DiffLlamaAttention\) attends 2 times over its keys and values"),
                            ("dory", "layer .* attended twice in one forward")):
        with pytest.raises(ValueError, match=why):
            load_model(resolve_model(_write(tmp_path / model_type, model_type)[0]))
    # what the engine cannot split or adapt
    from actors.engine.args import EngineArgs
    arch = model_config(resolve_model(path))
    for flags, name in (({"tensor_parallel_size": 2, "enable_expert_parallel": True}, "--enable-expert-parallel"),
                        ({"enable_lora": True, "pipeline_parallel_size": 2}, "--enable-lora with --pipeline-parallel-size"),
                        ({"speculative_config": {"method": "self_draft", "quantization": "gguf-i8",
                                                 "num_speculative_tokens": 2}}, "--speculative-config")):
        with pytest.raises(ValueError, match=f"the transformers backend .*: {name} is not supported"):
            EngineArgs(model=path, kv_cache_bytes=1 << 24, **flags).create_engine_config().resolve(
                cuda_available=False, cpu_count=2, arch=arch)
