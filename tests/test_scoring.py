import math

import pytest
import torch

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import score_texts
from probdiff_callback.core.prompts import chat_prompt_ids
from probdiff_callback.core.scoring import score_batch, token_logprobs_chunked


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
    [(mean, n)] = score_texts(model, tokenizer, [prompt], [response], config)
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
